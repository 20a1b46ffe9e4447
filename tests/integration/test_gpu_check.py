"""The prepared GPU check runs its steps on a CPU (``--dry-run``), so that the script a lent GPU machine runs once
is tested here first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_dry_run_passes_every_step_it_can_run_on_a_cpu() -> None:
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu-check.sh"), "--dry-run"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["failed"] == []
    # The reference shape, counted on the meta device, has the reference seed's 1,711,376,384 parameters.
    assert result["shape"]["parameters"] == 1_711_376_384
    assert result["training_step"]["replay_bit_identical"] is True
    assert result["checkpoint"]["stored_names_are_the_seeds"] is True
    assert result["evaluation"]["numerics"] == "bfloat16"  # the reference plan's, as on the GPU
    assert result["evaluation"]["rows_without_nan"] == result["evaluation"]["batch_size"]
    assert result["deterministic_mode"] == {
        "skipped": "needs a CUDA device",
        "step_seconds": 0.0,
        "held_at_start_bytes": None,
        "outside_allocator_after_bytes": None,
    }
    # Two updates of each profiled length, in order (the CPU has no allocator peaks to read).
    profiled = result["memory_profile"]["one_document"]
    assert [(u["update"], u["document_tokens"]) for u in profiled] == [(1, [32]), (2, [32]), (3, [128]), (4, [128])]
    assert [u["document_tokens"] for u in result["memory_profile"]["two_documents_ddp"]] == [[128, 128]] * 2
    progress = [json.loads(line) for line in done.stderr.splitlines()]
    assert [event["step"] for event in progress][-1] == "evaluation"


def test_the_gpu_check_without_a_gpu_and_without_dry_run_is_refused() -> None:
    env = {**os.environ, "PYTHON": sys.executable}  # an interpreter with every package: only the GPU is missing
    done = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu-check.sh")], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2
    assert "use --dry-run" in done.stderr


def test_the_gpu_check_runs_the_steps_it_is_asked_for_and_refuses_an_unknown_one() -> None:
    check = ["bash", str(ROOT / "bench" / "gpu-check.sh"), "--dry-run", "--steps"]
    done = subprocess.run([*check, "versions,shape"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert {"versions", "shape"} <= set(result) and "training_step" not in result
    refused = subprocess.run([*check, "shape,nonsense"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "no step named nonsense" in refused.stderr
