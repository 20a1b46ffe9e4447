"""The commitment ledger: an append-only hash chain that anyone can verify offline.

Each entry's hash is the identity of ``{seq, kind, identity, body, prev_hash}``; the first entry's
``prev_hash`` is ``GENESIS``. The coordinator appends entries; ``coop report`` verifies an exported chain.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from experiment.core.canonical import JsonObject, identity
from experiment.core.errors import CoopError

GENESIS = "0" * 64
_SHA256 = re.compile("^[0-9a-f]{64}$")
KINDS = ("plan", "prepared", "selection", "tested", "serving", "report")


class Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seq: int
    kind: str
    identity: str
    body: dict[str, Any]
    prev_hash: str
    hash: str


def entry_hash(seq: int, kind: str, identity_: str, body: JsonObject, prev_hash: str) -> str:
    return identity({"seq": seq, "kind": kind, "identity": identity_, "body": body, "prev_hash": prev_hash})


def next_entry(previous: Entry | None, kind: str, identity_: str, body: JsonObject) -> Entry:
    """The entry that follows ``previous`` (or starts the chain when it is None)."""
    if kind not in KINDS:
        raise CoopError(f"unknown commitment kind {kind!r}; expected one of {', '.join(KINDS)}")
    if not _SHA256.match(identity_):
        raise CoopError(f"commitment identity {identity_!r} is not a sha256 hex digest")
    seq = 1 if previous is None else previous.seq + 1
    prev_hash = GENESIS if previous is None else previous.hash
    return Entry(seq, kind, identity_, body, prev_hash, entry_hash(seq, kind, identity_, body, prev_hash))


def verify_ledger(entries: Sequence[Entry]) -> None:
    """Refuse a chain with a gap, a broken link or an entry whose hash does not match its content."""
    prev_hash = GENESIS
    for position, entry in enumerate(entries, start=1):
        if entry.seq != position:
            raise CoopError(f"ledger seq {entry.seq}: expected seq {position} (an entry is missing or out of order)")
        if entry.kind not in KINDS:
            raise CoopError(f"ledger seq {entry.seq}: unknown kind {entry.kind!r}")
        if not _SHA256.match(entry.identity):
            raise CoopError(f"ledger seq {entry.seq}: identity is not a sha256 hex digest")
        if entry.prev_hash != prev_hash:
            raise CoopError(f"ledger seq {entry.seq}: prev_hash does not link to the hash of seq {entry.seq - 1}")
        expected = entry_hash(entry.seq, entry.kind, entry.identity, entry.body, entry.prev_hash)
        if entry.hash != expected:
            raise CoopError(f"ledger seq {entry.seq}: hash does not match the entry's content (it was altered)")
        prev_hash = entry.hash


def decode_ledger(data: bytes, origin: str) -> list[Entry]:
    try:
        return msgspec.json.decode(data, type=list[Entry])
    except msgspec.ValidationError as exc:
        raise CoopError(f"ledger {origin} is malformed: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise CoopError(f"ledger {origin} is not valid JSON: {exc}") from exc


def read_ledger(path: Path) -> list[Entry]:
    """An exported ledger (a JSON array of entries), verified."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CoopError(f"cannot read ledger {path}: {exc.strerror}") from exc
    entries = decode_ledger(data, str(path))
    verify_ledger(entries)
    return entries
