"""Canonical JSON, sha256 identities and atomic, never-overwriting file writes.

One implementation used everywhere: every identity in coop is ``identity(obj)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from experiment.core.errors import CoopError

# A JSON value and a JSON object, as json.loads and msgspec decode them: for documents whose shape is free (event
# and ledger bodies, progress events). msgspec cannot decode into this recursive alias: a Struct field that must be
# decoded takes a precise type instead.
Json: TypeAlias = str | int | float | bool | list["Json"] | dict[str, "Json"] | None
JsonObject: TypeAlias = dict[str, Json]
# A JSON value as a writer takes it (json.dumps, an event's emitter): read only, so any mapping or sequence of JSON
# values is one (a dict[str, str], a list[str]), where a mutable dict[str, Json] would refuse them.
JsonLike: TypeAlias = str | int | float | bool | Sequence["JsonLike"] | Mapping[str, "JsonLike"] | None


def canonical_bytes(obj: Any) -> bytes:
    """Sorted keys, compact separators, ASCII only; NaN and infinities are refused."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except ValueError as exc:
        raise CoopError(f"cannot write canonical JSON: {exc}") from exc
    return text.encode("ascii")


def identity(obj: Any) -> str:
    """The sha256 hex digest of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_bytes(obj)).hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file or a folder (its entries: a rename or link into it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int:
    """The space left on the disk that holds ``path`` (or the nearest folder above it that exists)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside ``path``, fsync it, rename it over ``path``, fsync the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp creates 0600; records are meant to be read by anyone on the host
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_new_bytes(path: Path, data: bytes) -> None:
    """Record a new file: refuse to overwrite, but accept an identical existing file (a replay)."""
    if path.exists():
        if path.read_bytes() == data:
            return
        raise CoopError(f"{path} already exists with different content; refusing to overwrite it")
    atomic_write_bytes(path, data)


def write_new_json(path: Path, obj: Any) -> None:
    """Canonical JSON plus a newline, written with ``write_new_bytes``."""
    write_new_bytes(path, canonical_bytes(obj) + b"\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError as exc:
        raise CoopError(f"{path} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise CoopError(f"{path} is not valid JSON: {exc}") from exc
