"""What a rank needs before it trains, checked before its first update: GPU memory and disk.

The memory rule: experiment.learning.memory's peak for a rank of the run (float32 weights, gradients, AdamW's two
moments, a later document's gradient, the longest document's activations, the cuBLAS workspaces and, for a rank of a
DDP group, DDP's gradient buckets and NCCL's buffers) less the rank's own CUDA context, which exists when the check
reads the free memory, plus the plan's ``runtime.memory_headroom_gib`` for what the caching allocator reserves beyond
what it hands out (1.65 GB at most on the H200 check, bench/results/gpu-check-h200.json). A checkpoint holds the
float32 weights and both moments, 12 bytes a parameter, and a run keeps every checkpoint of the plan's
``checkpoint_steps``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from experiment.core.errors import CoopError
from experiment.core.plan import CHECKPOINT_BYTES_PER_PARAMETER, Plan
from experiment.learning import memory

if TYPE_CHECKING:
    import torch

GIB = 2**30


def memory_needed(plan: Plan, world_size: int) -> int:
    """Bytes of GPU memory one rank of a run of ``world_size`` ranks needs free once its CUDA context exists."""
    estimate = memory.training_rank(plan, world_size)
    return estimate.total - estimate.term("cuda context") + int(plan.runtime.memory_headroom_gib * GIB)


def disk_needed(plan: Plan, held_steps: set[int]) -> int:
    """Bytes the checkpoints a run has still to write take: one for each checkpoint step it does not hold."""
    missing = [step for step in plan.training.checkpoint_steps if step not in held_steps]
    return len(missing) * plan.checkpoint_bytes()


def check_memory(plan: Plan, world_size: int, device: torch.device) -> None:
    """Refuse to train on a GPU whose free memory is less than ``memory_needed`` (no check on a CPU)."""
    if device.type != "cuda":
        return
    import torch  # here: the doctor reads this module's rules without torch

    free, _total = torch.cuda.mem_get_info(device)
    needed = memory_needed(plan, world_size)
    if free < needed:
        estimate = memory.training_rank(plan, world_size)
        raise CoopError(
            f"GPU {device} has {free / GIB:.1f} GiB free; a rank of a {world_size}-rank run of this plan needs "
            f"{needed / GIB:.1f} GiB at its peak ({estimate.what}): {estimate.describe()}, less the CUDA context "
            f"this process already holds, + {plan.runtime.memory_headroom_gib:g} GiB headroom "
            "(experiment/learning/memory.py): free the GPU (nvidia-smi lists what holds it) or use a larger card"
        )


def check_disk(plan: Plan, folder: Path, held_steps: set[int]) -> None:
    """Refuse to train when the file system of ``folder`` cannot hold the checkpoints the run has still to write."""
    needed = disk_needed(plan, held_steps)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise CoopError(
            f"{folder} has {free / GIB:.1f} GiB free; the run's checkpoints still to write need {needed / GIB:.1f} "
            f"GiB ({CHECKPOINT_BYTES_PER_PARAMETER} B a parameter each): put the agent's work folder on a larger "
            "volume (the runbook puts it on the instance's NVMe)"
        )
