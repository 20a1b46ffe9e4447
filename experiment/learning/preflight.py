"""What a rank needs before it trains, checked before its first update: GPU memory and disk.

The memory rule: float32 weights, gradients and AdamW's two moments take 16 bytes a parameter, and each later
document of an update runs its forward and backward on top of the gradients the first left (4 bytes a parameter
more, and the plan's headroom the rest: 7.4 GB for the 1.7B seed under bfloat16 autocast, nearly independent of
the document's length, measured on an H200 by bench/gpu_check.py in bench/results/gpu-check-h200.json).
The design note's rule counted the 16 bytes only, which the measured peak exceeds (docs/protocol.md). A rank of a
DDP group also holds DDP's gradient buckets, one more float32 copy of the gradients (4 bytes a parameter). A
checkpoint holds the float32 weights and both moments, 12 bytes a parameter, and a run keeps every checkpoint of
the plan's ``checkpoint_steps``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from experiment.core.errors import CoopError
from experiment.core.plan import CHECKPOINT_BYTES_PER_PARAMETER, Plan

if TYPE_CHECKING:
    import torch

GIB = 2**30
# float32 weights, gradients, AdamW's exp_avg and exp_avg_sq; and a later document's forward and backward
TRAINING_BYTES_PER_PARAMETER = 20
BUCKET_BYTES_PER_PARAMETER = 4  # DDP's gradient buckets, float32


def memory_needed(plan: Plan, world_size: int) -> int:
    """Bytes of GPU memory one rank of a run of ``world_size`` ranks needs."""
    per_parameter = TRAINING_BYTES_PER_PARAMETER + (BUCKET_BYTES_PER_PARAMETER if world_size > 1 else 0)
    return plan.seed.parameters * per_parameter + int(plan.runtime.memory_headroom_gib * GIB)


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
        raise CoopError(
            f"GPU {device} has {free / GIB:.1f} GiB free; a rank of a {world_size}-rank run of this plan needs "
            f"{needed / GIB:.1f} GiB (parameters x {TRAINING_BYTES_PER_PARAMETER} B"
            f"{f' + {BUCKET_BYTES_PER_PARAMETER} B of DDP buckets' if world_size > 1 else ''}"
            f" + {plan.runtime.memory_headroom_gib:g} GiB headroom)"
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
