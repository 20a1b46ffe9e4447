"""scripts/wheel_collisions.py's offline parts: which wheel pip takes for CPython 3.11 on manylinux_2_35 x86_64, and
where a wheel's members land in the venv (a .data folder's purelib and platlib in site-packages, its own .dist-info
written by no other wheel); the collision check itself is in test_locks.py."""

from __future__ import annotations

import sys

import pytest

from tests.support import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import wheel_collisions


def test_the_most_preferred_fitting_tag_wins() -> None:
    files = [
        "cuda_python-12.6.2.post1-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
        "cuda_python-12.6.2.post1-cp311-cp311-win_amd64.whl",
        "cuda_python-12.6.2.post1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "cuda_python-12.6.2.post1-cp311-cp311-manylinux_2_28_x86_64.whl",
        "cuda_python-12.6.2.post1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "cuda_python-12.6.2.post1.tar.gz",
    ]
    assert wheel_collisions.best_wheel(files) == "cuda_python-12.6.2.post1-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert wheel_collisions.best_wheel(["pip-26.3-py3-none-any.whl"]) == "pip-26.3-py3-none-any.whl"


@pytest.mark.parametrize(
    "files",
    [
        ["vllm-0.32.0.tar.gz"],
        ["x-1.0-cp311-cp311-manylinux_2_39_x86_64.whl"],  # a newer glibc than the hosts'
        ["x-1.0-cp312-cp312-manylinux_2_28_x86_64.whl", "x-1.0-cp311-cp311-macosx_11_0_arm64.whl"],
    ],
)
def test_no_wheel_for_the_hosts_is_none(files: list[str]) -> None:
    assert wheel_collisions.best_wheel(files) is None


def test_members_land_where_pip_puts_them() -> None:
    place = wheel_collisions.installed_path
    assert place("cuda/bindings/__init__.py") == "cuda/bindings/__init__.py"
    assert place("nvidia_nccl-2.29.7.data/platlib/nvidia/nccl/lib/libnccl.so.2") == "nvidia/nccl/lib/libnccl.so.2"
    assert place("x-1.0.data/scripts/tool") == "<scripts>/tool"
    assert place("cuda_python-13.4.4.dist-info/RECORD") is None
