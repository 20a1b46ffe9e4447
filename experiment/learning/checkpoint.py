"""Checkpoints on every rank: safetensors weights, optimizer and RNG state, a receipt, and a pointer.

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
from typing import Any, NamedTuple

import msgspec
import safetensors.torch
import torch

from experiment.core.canonical import (
    canonical_bytes,
    free_bytes,
    read_json,
    sha256_bytes,
    sha256_file,
    write_new_bytes,
    write_new_json,
)
from experiment.core.errors import CoopError
from experiment.learning.records import Pointer, StepRecord  # shared with the agent and the coordinator's wire
from experiment.seed import seedmodel

MODEL_DIR = "model"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
RECEIPT = "receipt.json"
WEIGHTS = "model.safetensors"
# What the checkpoint writes itself; the seed's other files (tokenizer, chat template) are copied beside them so
# that a checkpoint's model/ is a complete model folder. Weights in any other file (shards, their index) stay out.
MODEL_FILES = ("config.json", "generation_config.json", WEIGHTS)
# Room a checkpoint takes beyond its tensors and the seed's files: the configs, the receipt, the pointer, and the
# framing of torch.save's archives (a few KiB each); file system blocks round every file up as well.
SLACK_BYTES = 1 << 20


class Receipt(msgspec.Struct, frozen=True):
    step: int
    binding: str
    parameter_digest: str
    files: dict[str, str]  # path relative to the checkpoint folder -> sha256
    journal: list[StepRecord]


def _name(step: int) -> str:
    return f"step-{step:06d}"


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
    """The seed's files a checkpoint's model folder copies (its tokenizer, chat template): all but the weights and
    the files the checkpoint writes itself."""
    return [
        source
        for source in sorted(seed_dir.iterdir())
        if source.is_file() and source.name not in MODEL_FILES and ".safetensors" not in source.name
    ]


def space_needed(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    seed_dir: Path,
    layout: seedmodel.TensorLayout,
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


def _files_under(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def _in_layout(model: torch.nn.Module, layout: seedmodel.TensorLayout) -> dict[str, torch.Tensor]:
    """The model's tensors under the seed's names and shapes. A tied weight is one tensor under two names in the
    model (``lm_head.weight`` is ``model.embed_tokens.weight``); it is stored once, under the name the seed stores
    it by, as every loader (vLLM's included) reads the seed's own folders."""
    state = model.state_dict()
    named = {name: tuple(state[name].shape) for name in layout if name in state}
    problems = seedmodel.layout_differences(named, layout)
    stored = {state[name].data_ptr() for name in named}
    untied = sorted(name for name in state.keys() - layout.keys() if state[name].data_ptr() not in stored)
    problems += [f"extra {name}" for name in untied]
    if problems:
        raise CoopError(f"the trained model does not fit the seed's tensor layout: {'; '.join(problems)}")
    return {name: state[name].detach().cpu().contiguous() for name in sorted(layout)}


def _save_model(model: torch.nn.Module, folder: Path, layout: seedmodel.TensorLayout) -> None:
    """The weights and configs as a Hugging Face model folder, on every rank (transformers' save_pretrained
    writes nothing on a rank other than 0 once torch.distributed is initialised; each host needs its own copy)."""
    config: Any = getattr(model, "config")  # noqa: B009 (a transformers model)
    config.save_pretrained(folder)
    generation: Any = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
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
    layout: seedmodel.TensorLayout,
    extra: Mapping[str, object] | None = None,
) -> Pointer:
    """Write the checkpoint into a temporary folder, rename it into place, then write its pointer. The weights
    take the seed's tensor ``layout``; its other files come from ``seed_dir``. Each file is hashed once, into the
    receipt, and reaches the disk (fsync) before the rename: nothing needs to read it back. A write that fails
    for want of space removes the temporary folder and says how much the checkpoint needs."""
    final = run_dir / "checkpoints" / _name(step)
    if final.exists():
        raise CoopError(f"checkpoint {final} already exists; refusing to overwrite it")
    staging = run_dir / "checkpoints" / f".{_name(step)}.partial"
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
    layout: seedmodel.TensorLayout,
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
        step=step, binding=binding, parameter_digest=parameter_digest, files=_files_under(staging), journal=journal
    )
    receipt_bytes = canonical_bytes(msgspec.to_builtins(receipt)) + b"\n"
    write_new_bytes(staging / RECEIPT, receipt_bytes)
    for path in staging.rglob("*"):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    return receipt_bytes


def pointers(run_dir: Path) -> list[Pointer]:
    folder = run_dir / "pointers"
    found = []
    for path in sorted(folder.glob("step-*.json")) if folder.is_dir() else []:
        try:
            found.append(msgspec.convert(read_json(path), type=Pointer))
        except msgspec.ValidationError as exc:
            raise CoopError(f"pointer {path} is malformed: {exc}") from exc
    return found


class Held(NamedTuple):
    """A run's checkpoints by step: those with a pointer, and complete folders a kill left without one (it came
    between the folder's rename and the pointer's write), each with the pointer it would have. An unpointed
    checkpoint is vouched for by nothing yet: a rank never resumes from it, it retrains to it and confirms it."""

    pointed: dict[int, Pointer]
    unpointed: dict[int, Pointer]


def held(run_dir: Path) -> Held:
    found = pointers(run_dir)
    named = {p.checkpoint for p in found}
    unpointed = {}
    folder = run_dir / "checkpoints"
    for checkpoint in sorted(folder.glob("step-*")) if folder.is_dir() else []:
        if checkpoint.name not in named:
            receipt = checkpoint / RECEIPT
            if not receipt.is_file():
                raise CoopError(f"checkpoint {checkpoint} has no pointer and no receipt")
            step = int(checkpoint.name.removeprefix("step-"))
            unpointed[step] = Pointer(step=step, checkpoint=checkpoint.name, receipt_sha256=sha256_file(receipt))
    return Held({p.step: p for p in found}, unpointed)


def kept(
    run_dir: Path, held: Held, step: int, binding: str, parameter_digest: str, layout: seedmodel.TensorLayout
) -> tuple[Pointer, str] | None:
    """The checkpoint an earlier attempt left at ``step``, confirmed against the weights this run retrained to it,
    and what was written for it: ``"nothing"``, or ``"pointer"`` for one a kill left unpointed. None: there is
    none, and the caller saves one."""
    pointer = held.pointed.get(step) or held.unpointed.get(step)
    if pointer is None:
        return None
    confirm(run_dir, pointer, binding, parameter_digest, layout)
    if step in held.pointed:
        return pointer, "nothing"
    point(run_dir, pointer)
    return pointer, "pointer"


def point(run_dir: Path, pointer: Pointer) -> None:
    """Write a checkpoint's pointer, a new file."""
    write_new_json(run_dir / "pointers" / f"{_name(pointer.step)}.json", msgspec.to_builtins(pointer))


def confirm(
    run_dir: Path, pointer: Pointer, binding: str, parameter_digest: str, layout: seedmodel.TensorLayout
) -> None:
    """A checkpoint an earlier attempt wrote at this step must hold the weights this run just computed there
    (a rank that resumed behind its own latest checkpoint, to meet its peers or to reach one a kill left
    unpointed, retrains those steps)."""
    receipt = verify(run_dir, pointer, binding, layout)
    if receipt.parameter_digest != parameter_digest:
        raise CoopError(
            f"checkpoint {run_dir / 'checkpoints' / pointer.checkpoint} holds parameter digest "
            f"{receipt.parameter_digest[:16]}, but retraining to step {pointer.step} gave {parameter_digest[:16]}: "
            "the run is not reproducible on this host; it is kept as it is and this run stops"
        )


def verify(run_dir: Path, pointer: Pointer, binding: str, layout: seedmodel.TensorLayout) -> Receipt:
    """The receipt matches the pointer, every file its hash, the binding the run's, and the weights the seed's
    tensor layout (the names and shapes every loader reads a folder of this model by)."""
    folder = run_dir / "checkpoints" / pointer.checkpoint
    receipt_path = folder / RECEIPT
    if not receipt_path.is_file():
        raise CoopError(f"checkpoint {folder} has no receipt")
    if sha256_file(receipt_path) != pointer.receipt_sha256:
        raise CoopError(
            f"receipt {receipt_path} does not match the sha256 that its pointer "
            f"pointers/{folder.name}.json records: one of the two was changed"
        )
    try:
        receipt = msgspec.convert(read_json(receipt_path), type=Receipt)
    except msgspec.ValidationError as exc:
        raise CoopError(f"receipt {receipt_path} is malformed: {exc}") from exc
    if receipt.step != pointer.step:
        raise CoopError(f"receipt {receipt_path} is for step {receipt.step}, its pointer says {pointer.step}")
    if receipt.binding != binding:
        raise CoopError(
            f"checkpoint {folder} belongs to binding {receipt.binding[:16]}, this run is "
            f"{binding[:16]}: different inputs, profile, arm or world"
        )
    present = {name: digest for name, digest in _files_under(folder).items() if name != RECEIPT}
    for name in sorted(set(receipt.files) | set(present)):
        if name not in present:
            raise CoopError(f"checkpoint file {folder / name} is missing")
        if name not in receipt.files:
            raise CoopError(f"checkpoint file {folder / name} is not in the receipt")
        if present[name] != receipt.files[name]:
            raise CoopError(f"checkpoint file {folder / name} does not match its receipt's sha256")
    weights = folder / MODEL_DIR / WEIGHTS
    problems = seedmodel.layout_differences(seedmodel.tensor_layout(weights.parent), layout)
    if problems:
        raise CoopError(f"checkpoint weights {weights} are not in the seed's tensor layout: {'; '.join(problems)}")
    return receipt


def load_state(run_dir: Path, pointer: Pointer, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Restore optimizer and RNG state (weights load from the checkpoint's model folder). The optimizer's moments
    load straight onto ``device``: whatever device saved them, no second copy passes through host memory."""
    folder = run_dir / "checkpoints" / pointer.checkpoint
    optimizer.load_state_dict(torch.load(folder / OPTIMIZER, weights_only=True, map_location=device))
    rng = torch.load(folder / RNG, weights_only=True)
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def model_dir(run_dir: Path, pointer: Pointer) -> Path:
    return run_dir / "checkpoints" / pointer.checkpoint / MODEL_DIR


def load_extra(run_dir: Path, pointer: Pointer, name: str) -> Any:
    """State the run saved beside the optimizer's under ``name`` (verified with the checkpoint's receipt)."""
    path = run_dir / "checkpoints" / pointer.checkpoint / name
    if not path.is_file():
        raise CoopError(f"checkpoint {pointer.checkpoint} has no {name}; this run resumes only from its full state")
    return torch.load(path, weights_only=True)
