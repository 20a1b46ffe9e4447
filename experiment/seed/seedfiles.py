"""A seed folder's files: its snapshot (every file's sha256, the tokenizer's identity, the parameter count), its
verification against a snapshot, and the tensor layout its safetensors headers declare, all read without loading
the model (no torch).

Every command that loads a seed verifies it first; a checkpoint is checked against the seed's tensor layout."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec

from experiment.core.canonical import read_json, sha256_file
from experiment.core.errors import CoopError
from experiment.seed.seedtokenizer import tokenizer_identity


class Snapshot(msgspec.Struct, frozen=True):
    """What a seed directory must hold, byte for byte."""

    files: dict[str, str]
    tokenizer_identity: str
    parameters: int


def _files_of(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        raise CoopError(f"seed directory {directory} does not exist")
    return {
        path.relative_to(directory).as_posix(): sha256_file(path)
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


TensorLayout = dict[str, tuple[int, ...]]  # tensor name -> shape, as a model folder's safetensors files hold them


def safetensors_layout(path: Path) -> TensorLayout:
    """The tensors of one safetensors file, read from its header (no weights are loaded)."""
    try:
        with path.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
    except (OSError, ValueError) as exc:
        raise CoopError(f"{path} is not a readable safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise CoopError(f"{path} has a safetensors header that is not an object")
    try:
        return {name: tuple(int(n) for n in entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except (KeyError, TypeError, ValueError) as exc:
        raise CoopError(f"{path} has a safetensors header without tensor shapes: {exc}") from exc


def tensor_layout(directory: Path) -> TensorLayout:
    """Every tensor a model folder stores, by name (tied weights are stored once, under one name)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CoopError(f"model folder {directory} has no *.safetensors weights file")
    layout: TensorLayout = {}
    for path in files:
        for name, shape in safetensors_layout(path).items():
            if name in layout:
                raise CoopError(f"{directory} stores tensor {name} twice")
            layout[name] = shape
    return layout


def layout_differences(found: TensorLayout, expected: TensorLayout) -> list[str]:
    """What keeps ``found`` from being ``expected``: missing and extra tensor names, and other shapes."""
    problems = [f"missing {name}" for name in sorted(expected.keys() - found.keys())]
    problems += [f"extra {name}" for name in sorted(found.keys() - expected.keys())]
    problems += [
        f"{name} has shape {list(found[name])}, the seed's {list(shape)}"
        for name, shape in sorted(expected.items())
        if name in found and found[name] != shape
    ]
    return problems


def count_parameters(directory: Path) -> int:
    """Parameters stored in the safetensors files, read from their headers (tied weights are stored once)."""
    return sum(math.prod(shape) for shape in tensor_layout(directory).values())


def snapshot_of(directory: Path) -> Snapshot:
    return Snapshot(
        files=_files_of(directory),
        tokenizer_identity=tokenizer_identity(directory),
        parameters=count_parameters(directory),
    )


def verify_seed(directory: Path, snapshot: Snapshot) -> None:
    """Refuse any missing, extra or changed file, and any other tokenizer identity or parameter count."""
    found = _files_of(directory)
    for name in sorted(snapshot.files.keys() - found.keys()):
        raise CoopError(f"seed file {directory / name} is missing")
    for name in sorted(found.keys() - snapshot.files.keys()):
        raise CoopError(f"seed file {directory / name} is not in the snapshot (extra file)")
    for name, digest in sorted(snapshot.files.items()):
        if found[name] != digest:
            raise CoopError(f"seed file {directory / name} has sha256 {found[name]}, expected {digest}")
    actual_identity = tokenizer_identity(directory)
    if actual_identity != snapshot.tokenizer_identity:
        raise CoopError(
            f"tokenizer identity of {directory} is {actual_identity}, expected {snapshot.tokenizer_identity}"
        )
    parameters = count_parameters(directory)
    if parameters != snapshot.parameters:
        raise CoopError(f"{directory} holds {parameters} parameters, expected {snapshot.parameters}")


def verify_written(directory: Path, snapshot: Snapshot) -> None:
    """Refuse any file ``directory`` holds so far that the snapshot does not list, or records other bytes of: a
    folder being written is checked before the rest of it is made (``verify_seed`` checks it whole)."""
    for name, digest in sorted(_files_of(directory).items()):
        if name not in snapshot.files:
            raise CoopError(f"seed file {directory / name} is not in the snapshot (extra file)")
        if digest != snapshot.files[name]:
            raise CoopError(f"seed file {directory / name} has sha256 {digest}, expected {snapshot.files[name]}")


def read_snapshot(path: Path) -> Snapshot:
    try:
        return msgspec.convert(read_json(path), Snapshot)
    except msgspec.ValidationError as exc:
        raise CoopError(f"{path} is not a seed snapshot: {exc}") from exc
