"""Checkpoints on every rank: safetensors weights, optimizer and RNG state, a receipt, and a pointer; their writing
and loading (torch). Their reading and verification, from their files alone, is experiment.learning.receipts.

Each checkpoint and each pointer is a new file (``pointers/step-000064.json``); the latest pointer is
the highest step. Verification refuses any mismatch and names it. A disk without room for a checkpoint ends the run
with a message naming the folder and the bytes needed; nothing of that checkpoint stays, so the run resumes from
its last whole one once space is freed."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import safetensors.torch
import torch

from experiment.core.canonical import (
    canonical_bytes,
    free_bytes,
    sha256_bytes,
    write_new_bytes,
)
from experiment.core.errors import CoopError
from experiment.learning.receipts import (
    MODEL_DIR,
    RECEIPT,
    WEIGHTS,
    Receipt,
    checkpoint_name,
    files_under,
    point,
)
from experiment.learning.records import Pointer, StepRecord
from experiment.seed.seedfiles import TensorLayout, layout_differences

OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
# Room a checkpoint takes beyond its tensors and the seed's files: the configs, the receipt, the pointer, and the
# framing of torch.save's archives (a few KiB each); file system blocks round every file up as well.
SLACK_BYTES = 1 << 20


def _tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in a (nested) state."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(_tensor_bytes(value) for value in state)
    return 0


def _seed_files(seed_dir: Path) -> list[Path]:
    """The seed's files a checkpoint's model folder copies beside its weights, so that it is a complete model folder:
    configs, tokenizer, chat template. The trained weights have the seed's shapes (the tensor layout), so the seed's
    config.json describes them. Weights in any other file (shards, their index) stay out."""
    return [source for source in sorted(seed_dir.iterdir()) if source.is_file() and ".safetensors" not in source.name]


def space_needed(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    seed_dir: Path,
    layout: TensorLayout,
    extra: Mapping[str, object],
) -> int:
    """About the bytes a checkpoint of this run writes: its weights in the seed's layout, the optimizer's state,
    the run's extra state, the seed's copied files and ``SLACK_BYTES``."""
    state = model.state_dict()
    weights = sum(_tensor_bytes(state[name]) for name in layout if name in state)
    copied = sum(source.stat().st_size for source in _seed_files(seed_dir))
    return weights + _tensor_bytes(optimizer.state_dict()) + _tensor_bytes(extra) + copied + SLACK_BYTES


def no_space(run_dir: Path, step: int, needed: int) -> str | None:
    """Why the checkpoint of ``step`` cannot be written under ``run_dir`` (``needed`` bytes), or None if it fits."""
    folder = run_dir / "checkpoints"
    free = free_bytes(folder)
    return None if free >= needed else _no_space(folder, step, needed, free)


def _no_space(folder: Path, step: int, needed: int, free: int) -> str:
    return (
        f"no space for the checkpoint of step {step} in {folder}: it needs about {needed} bytes and {free} are "
        "free; this run ends unfinished and resumes from its last checkpoint once space is freed"
    )


def _full(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is a full disk's."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _in_layout(model: torch.nn.Module, layout: TensorLayout) -> dict[str, torch.Tensor]:
    """The model's tensors under the seed's names and shapes. A tied weight is one tensor under two names in the
    model (``lm_head.weight`` is ``model.embed_tokens.weight``); it is stored once, under the name the seed stores
    it by, as every loader (vLLM's included) reads the seed's own folders."""
    state = model.state_dict()
    named = {name: tuple(state[name].shape) for name in layout if name in state}
    problems = layout_differences(named, layout)
    stored = {state[name].data_ptr() for name in named}
    untied = sorted(name for name in state.keys() - layout.keys() if state[name].data_ptr() not in stored)
    problems += [f"extra {name}" for name in untied]
    if problems:
        raise CoopError(f"the trained model does not fit the seed's tensor layout: {'; '.join(problems)}")
    return {name: state[name].detach().cpu().contiguous() for name in sorted(layout)}


def _save_model(model: torch.nn.Module, folder: Path, layout: TensorLayout) -> None:
    """The weights in the seed's layout, on every rank: each host keeps its own copy."""
    safetensors.torch.save_file(_in_layout(model, layout), str(folder / WEIGHTS), metadata={"format": "pt"})


def save(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    binding: str,
    parameter_digest: str,
    journal: list[StepRecord],
    seed_dir: Path,
    layout: TensorLayout,
    extra: Mapping[str, object] | None = None,
) -> Pointer:
    """Write the checkpoint into a temporary folder, rename it into place, then write its pointer. The weights
    take the seed's tensor ``layout``; its other files come from ``seed_dir``. Each file is hashed once, into the
    receipt, and reaches the disk (fsync) before the rename: nothing needs to read it back. A write that fails
    for want of space removes the temporary folder and says how much the checkpoint needs."""
    final = run_dir / "checkpoints" / checkpoint_name(step)
    if final.exists():
        raise CoopError(f"checkpoint {final} already exists; refusing to overwrite it")
    staging = run_dir / "checkpoints" / f".{checkpoint_name(step)}.partial"
    if staging.exists():
        shutil.rmtree(staging)  # an unfinished write of a previous, interrupted attempt
    try:
        receipt = _write(staging, model, optimizer, binding, parameter_digest, journal, step, seed_dir, layout, extra)
    except Exception as exc:
        free = free_bytes(staging.parent)
        shutil.rmtree(staging, ignore_errors=True)
        needed = space_needed(model, optimizer, seed_dir, layout, extra or {})
        if _full(exc) or free < needed:  # torch.save's writer reports a full disk without its errno
            raise CoopError(_no_space(staging.parent, step, needed, free)) from exc
        raise
    staging.rename(final)
    pointer = Pointer(step=step, checkpoint=final.name, receipt_sha256=sha256_bytes(receipt))
    try:
        point(run_dir, pointer)
    except OSError as exc:  # the folder stays, unpointed: a later run retrains to it and confirms it (``held``)
        if not _full(exc):
            raise
        raise CoopError(_no_space(run_dir / "pointers", step, SLACK_BYTES, free_bytes(run_dir))) from exc
    return pointer


def _write(
    staging: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    binding: str,
    parameter_digest: str,
    journal: list[StepRecord],
    step: int,
    seed_dir: Path,
    layout: TensorLayout,
    extra: Mapping[str, object] | None,
) -> bytes:
    """The checkpoint's files in ``staging``, each on the disk; returns its receipt's bytes."""
    (staging / MODEL_DIR).mkdir(parents=True)
    _save_model(model, staging / MODEL_DIR, layout)
    for source in _seed_files(seed_dir):
        shutil.copyfile(source, staging / MODEL_DIR / source.name)
    torch.save(optimizer.state_dict(), staging / OPTIMIZER)
    rng: dict[str, torch.Tensor] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, staging / RNG)
    for name, state in (extra or {}).items():  # more of the run's state (a DiLoCo run's outer state)
        torch.save(state, staging / name)
    receipt = Receipt(
        step=step, binding=binding, parameter_digest=parameter_digest, files=files_under(staging), journal=journal
    )
    receipt_bytes = canonical_bytes(msgspec.to_builtins(receipt)) + b"\n"
    write_new_bytes(staging / RECEIPT, receipt_bytes)
    for path in staging.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    return receipt_bytes


def load_state(run_dir: Path, pointer: Pointer, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Restore optimizer and RNG state (weights load from the checkpoint's model folder). The optimizer's moments
    load straight onto ``device``: whatever device saved them, no second copy passes through host memory."""
    folder = run_dir / "checkpoints" / pointer.checkpoint
    optimizer.load_state_dict(torch.load(folder / OPTIMIZER, weights_only=True, map_location=device))
    rng = torch.load(folder / RNG, weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def load_extra(run_dir: Path, pointer: Pointer, name: str) -> Any:
    """State the run saved beside the optimizer's under ``name`` (verified with the checkpoint's receipt)."""
    path = run_dir / "checkpoints" / pointer.checkpoint / name
    if not path.is_file():
        raise CoopError(f"checkpoint {pointer.checkpoint} has no {name}; this run resumes only from its full state")
    return torch.load(path, weights_only=True)
