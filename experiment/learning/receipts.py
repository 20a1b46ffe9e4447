"""A checkpoint's receipt and pointer, read from its files alone (no torch): the checkpoints a run holds, each one
verified against its receipt and the seed's tensor layout, and confirmed against retrained weights.

Writing a checkpoint, and loading its state, is experiment.learning.checkpoint's."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import msgspec

from experiment.core.canonical import read_json, sha256_file, write_new_json
from experiment.core.errors import CoopError
from experiment.learning.records import Pointer, StepRecord  # shared with the agent and the coordinator's wire
from experiment.seed.seedfiles import TensorLayout, layout_differences, tensor_layout

MODEL_DIR = "model"
RECEIPT = "receipt.json"
WEIGHTS = "model.safetensors"


class Receipt(msgspec.Struct, frozen=True):
    step: int
    binding: str
    parameter_digest: str
    files: dict[str, str]  # path relative to the checkpoint folder -> sha256
    journal: list[StepRecord]


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def files_under(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


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
    run_dir: Path, held: Held, step: int, binding: str, parameter_digest: str, layout: TensorLayout
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
    write_new_json(run_dir / "pointers" / f"{checkpoint_name(pointer.step)}.json", msgspec.to_builtins(pointer))


def confirm(run_dir: Path, pointer: Pointer, binding: str, parameter_digest: str, layout: TensorLayout) -> None:
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


def verify(run_dir: Path, pointer: Pointer, binding: str, layout: TensorLayout) -> Receipt:
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
    present = {name: digest for name, digest in files_under(folder).items() if name != RECEIPT}
    for name in sorted(set(receipt.files) | set(present)):
        if name not in present:
            raise CoopError(f"checkpoint file {folder / name} is missing")
        if name not in receipt.files:
            raise CoopError(f"checkpoint file {folder / name} is not in the receipt")
        if present[name] != receipt.files[name]:
            raise CoopError(f"checkpoint file {folder / name} does not match its receipt's sha256")
    weights = folder / MODEL_DIR / WEIGHTS
    problems = layout_differences(tensor_layout(weights.parent), layout)
    if problems:
        raise CoopError(f"checkpoint weights {weights} are not in the seed's tensor layout: {'; '.join(problems)}")
    return receipt


def model_dir(run_dir: Path, pointer: Pointer) -> Path:
    return run_dir / "checkpoints" / pointer.checkpoint / MODEL_DIR
