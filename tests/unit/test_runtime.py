"""What a rank runs with, checked without a GPU: deterministic CUDA's environment, threads from the plan, the
preflights' arithmetic against the target's own figures, the collective timeout sized for its checkpoints, and
checkpoints hashed once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from experiment.core.errors import CoopError
from experiment.core.plan import load_plan, parse_plan
from experiment.learning import checkpoint, memory, preflight, receipts
from experiment.seed import seedmodel
from tests.support import ROOT

REFERENCE = ROOT / "plans" / "reference.toml"
LOCAL = ROOT / "plans" / "local.toml"
TINY = ROOT / "seeds" / "tiny"
GIB = 2**30

# Made in a fresh interpreter: deterministic mode and torch's threads are global to a process.
_DETERMINISTIC = """
import json, os, sys, torch
from experiment.core import determinism
determinism.make_deterministic(sys.argv[1], threads=int(sys.argv[2]))
print(json.dumps({
    "variable": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    "threads": torch.get_num_threads(),
    "tf32": torch.backends.cuda.matmul.allow_tf32,
    "profile": determinism.profile(sys.argv[1]),
}))
"""


def _deterministic(device: str, threads: int, **environment: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"} | environment
    done = subprocess.run(
        [sys.executable, "-c", _DETERMINISTIC, device, str(threads)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_deterministic_cuda_sets_cublas_workspace_before_any_cuda_work_and_records_it() -> None:
    """Without CUBLAS_WORKSPACE_CONFIG, torch's deterministic mode raises at the first cuBLAS matmul."""
    made = _deterministic("cuda", 2, OMP_NUM_THREADS="3")
    assert made["variable"] == ":4096:8"
    assert made["profile"] == {"deterministic": True, "cublas_workspace_config": ":4096:8"}
    assert made["tf32"] is False
    assert made["threads"] == 2  # the plan's, not OMP_NUM_THREADS


def test_deterministic_cpu_leaves_cublas_alone_and_takes_the_plans_threads() -> None:
    made = _deterministic("cpu", 1, OMP_NUM_THREADS="3")
    assert made["variable"] is None
    assert made["profile"] == {"deterministic": True, "cublas_workspace_config": None}
    assert made["threads"] == 1


def test_memory_preflight_covers_the_peaks_measured_on_a_gpu() -> None:
    """Against bench/gpu_check.py's run on an H200, capped at an L40S's memory: the real training step on the
    reference plan, 8 documents of 1,024 tokens an update, plain and under DDP. The rule must hold what the allocator
    took from the driver at its peak (reserved), and a rank of the pair must still fit the L40S."""
    measured = json.loads((ROOT / "bench" / "results" / "gpu-check-h200.json").read_text())
    plan = load_plan(REFERENCE)
    assert measured["plan"] == plan.name and measured["failed"] == []
    single = preflight.memory_needed(plan, world_size=1)
    pair = preflight.memory_needed(plan, world_size=2)
    assert measured["training_step"]["peak_reserved_bytes"] <= single
    assert measured["ddp_group_of_one"]["peak_reserved_bytes"] <= pair <= measured["memory_cap_bytes"]
    # Where the peak comes from: the second document's forward and backward run on top of the first's gradients.
    first, second = (u["forward_backward_above_held_bytes"] for u in measured["memory_profile"]["two_documents"])
    (one,) = {u["forward_backward_above_held_bytes"] for u in measured["memory_profile"]["one_document"][2:]}
    assert first == second == one + 4 * plan.seed.parameters
    # The memory model's peak (20 B a parameter, the activations and the workspaces; DDP's buckets and NCCL's
    # buffers more for a rank of the pair) and the plan's 4 GiB for what the allocator reserves beyond it.
    assert single == memory.training_rank(plan, 1).allocated + 4 * GIB
    assert pair - single == 4 * plan.seed.parameters + memory.NCCL_BYTES


def test_disk_preflight_counts_each_checkpoint_still_to_write(tmp_path: Path) -> None:
    """About 41 GB per arm on a host for the reference plan's two checkpoints (20.5 GB each, float32 weights and
    both AdamW moments); a run that holds one needs room for the other only."""
    plan = load_plan(REFERENCE)
    assert round(plan.checkpoint_bytes() / 1e9, 1) == 20.5
    assert round(preflight.disk_needed(plan, set()) / 1e9) == 41
    assert preflight.disk_needed(plan, {64}) == plan.checkpoint_bytes()
    assert preflight.disk_needed(plan, {64, 128}) == 0
    preflight.check_disk(plan, tmp_path, {64, 128})
    runtime = msgspec.structs.replace(plan.runtime, collective_timeout_seconds=86_400.0)
    huge = msgspec.structs.replace(plan, seed=msgspec.structs.replace(plan.seed, parameters=10**11), runtime=runtime)
    with pytest.raises(CoopError, match=r"GiB free; the run's checkpoints still to write need 2235\.2 GiB"):
        preflight.check_disk(huge, tmp_path, set())


def test_memory_preflight_passes_on_a_cpu() -> None:
    preflight.check_memory(load_plan(REFERENCE), 2, torch.device("cpu"))


def test_the_collective_timeout_outlasts_a_checkpoint_written_and_read_back_twice() -> None:
    """A 20.5 GB checkpoint at a gp3 volume's 125 MB/s: written and read back, twice over, is 657 s. The reference
    plan's 600 s would be refused; its 1,800 s is accepted. The small local seed keeps the default."""
    plan = load_plan(REFERENCE)
    assert round(plan.checkpoint_skew_bound_seconds()) == 657
    assert plan.runtime.collective_timeout_seconds == 1800.0
    text = REFERENCE.read_text()
    assert "collective_timeout_seconds = 1800.0" in text
    with pytest.raises(CoopError, match=r"collective_timeout_seconds must be at least .* 657 s for this seed"):
        parse_plan(
            text.replace("collective_timeout_seconds = 1800.0", "collective_timeout_seconds = 600.0").encode(), "x"
        )
    assert load_plan(LOCAL).runtime.collective_timeout_seconds == 600.0


def test_a_checkpoint_hashes_each_file_once_and_its_optimizer_loads_onto_the_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = seedmodel.load_model(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    hashed: list[Path] = []
    real = receipts.sha256_file

    def counting(path: Path) -> str:
        hashed.append(path)
        return real(path)

    monkeypatch.setattr(receipts, "sha256_file", counting)  # the receipt hashes each file as it is written
    layout = seedmodel.tensor_layout(TINY)
    pointer = checkpoint.save(tmp_path, 2, model, optimizer, "binding", "digest", [], TINY, layout)
    names = [p.name for p in hashed]
    assert names and len(names) == len(set(names)), names  # one hash per file, none read back
    monkeypatch.undo()
    receipt = receipts.verify(tmp_path, pointer, "binding", layout)  # what a resume checks
    assert receipt.parameter_digest == "digest"
    fresh = torch.optim.AdamW(seedmodel.load_model(receipts.model_dir(tmp_path, pointer)).parameters(), lr=1e-3)
    checkpoint.load_state(tmp_path, pointer, fresh, torch.device("cpu"))
    saved, loaded = optimizer.state_dict()["state"], fresh.state_dict()["state"]
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert torch.equal(saved[key]["exp_avg"], loaded[key]["exp_avg"])
        assert loaded[key]["exp_avg"].device.type == "cpu"
