"""Deterministic arithmetic, switched on in one place before a process does any CUDA work.

In deterministic mode torch raises at the first cuBLAS matmul unless ``CUBLAS_WORKSPACE_CONFIG`` fixes cuBLAS's
workspace. cuBLAS reads the variable when the process makes its first handle, that is at its first matmul, so
setting it here, before any CUDA work, is in time. TF32 is off: its rounding is not the float32 the plan records.
"""

from __future__ import annotations

import os

import torch

VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # one of the two settings cuBLAS documents as reproducible


def make_deterministic(device_type: str, threads: int) -> None:
    """Deterministic algorithms on ``device_type`` ("cpu" or "cuda") with ``threads`` intra-op threads, which come
    from the plan and never from the host's environment (OMP_NUM_THREADS differs between hosts)."""
    if device_type == "cuda":
        os.environ[VARIABLE] = CUBLAS_WORKSPACE_CONFIG
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def profile(device_type: str) -> dict[str, bool | str | None]:
    """What the profile of a run records of this: whether deterministic mode is on, and cuBLAS's workspace."""
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get(VARIABLE) if device_type == "cuda" else None,
    }
