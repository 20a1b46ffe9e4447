"""The doctor's check that a venv's compiled modules find the shared libraries they link (hostchecks.shared_libraries),
on real ELF files: a module compiled here against a library that is then taken away, which the real `ldd` reports
"not found" (vLLM's CPU build and libnuma on a host without it: its replica's first start fails)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from experiment.core import hostchecks


def _venv(tmp_path: Path, shipped: bool) -> Path:
    """A venv whose package ``vllm`` has one compiled module linked against libcoopgone.so, which is on no library
    path; ``shipped``: a wheel of the venv holds a library of that name (as torch/lib holds libtorch.so)."""
    cc = shutil.which("cc")
    assert cc is not None, "a C compiler is needed (the doctor's own check asks the same of a GPU host)"
    build = tmp_path / "build"
    build.mkdir()
    (build / "gone.c").write_text("int gone(void) { return 1; }\n")
    (build / "module.c").write_text("int gone(void);\nint use(void) { return gone(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", "libcoopgone.so", "gone.c"], cwd=build, check=True)
    package = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm"
    package.mkdir(parents=True)
    argv = [cc, "-shared", "-fPIC", "-o", str(package / "_C.abi3.so"), "module.c", "-L.", "-lcoopgone"]
    subprocess.run(argv, cwd=build, check=True)
    if shipped:
        (package.parent / "torch" / "lib").mkdir(parents=True)
        shutil.copyfile(build / "libcoopgone.so", package.parent / "torch" / "lib" / "libcoopgone.so")
    shutil.rmtree(build)
    return tmp_path / "venv"


def test_a_library_on_no_path_fails_naming_it_the_module_and_a_generic_fix(tmp_path: Path) -> None:
    found = hostchecks.shared_libraries(_venv(tmp_path, shipped=False), "vllm", hostchecks.command_output)
    assert not found.passed
    assert found.detail == "libcoopgone.so, which _C.abi3.so links, is on no library path"
    assert "apt-file search" in found.fix


def test_a_known_library_names_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(hostchecks.SYSTEM_LIBRARIES, "libcoopgone.so", "coop-gone1")
    found = hostchecks.shared_libraries(_venv(tmp_path, shipped=False), "vllm", hostchecks.command_output)
    assert (found.passed, found.fix) == (False, "apt-get install -y coop-gone1")


def test_a_library_a_wheel_of_the_venv_ships_passes(tmp_path: Path) -> None:
    found = hostchecks.shared_libraries(_venv(tmp_path, shipped=True), "vllm", hostchecks.command_output)
    assert found.passed, found


def test_a_venv_without_the_package_fails(tmp_path: Path) -> None:
    found = hostchecks.shared_libraries(tmp_path, "vllm", hostchecks.command_output)
    assert not found.passed and "holds no compiled module of vllm" in found.detail
