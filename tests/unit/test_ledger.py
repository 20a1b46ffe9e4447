"""The commitment ledger: a hash chain that any alteration, gap or reordering breaks, naming the seq."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import msgspec
import pytest

from experiment.core.errors import CoopError
from experiment.core.ledger import GENESIS, Entry, decode_ledger, next_entry, read_ledger, verify_ledger


def _digest(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


def _chain() -> list[Entry]:
    entries: list[Entry] = []
    for kind in ("plan", "prepared", "selection", "tested", "serving", "report"):
        entries.append(next_entry(entries[-1] if entries else None, kind, _digest(kind), {"kind": kind, "n": 1}))
    return entries


def test_chain_links_each_entry_to_the_previous_hash() -> None:
    entries = _chain()
    assert entries[0].seq == 1 and entries[0].prev_hash == GENESIS
    assert all(later.prev_hash == earlier.hash for earlier, later in itertools.pairwise(entries))
    verify_ledger(entries)


def test_altered_body_is_detected_at_its_seq() -> None:
    entries = _chain()
    entries[2] = msgspec.structs.replace(entries[2], body={"kind": "selection", "n": 2})
    with pytest.raises(CoopError, match="ledger seq 3: hash does not match"):
        verify_ledger(entries)


def test_rehashed_alteration_breaks_the_next_link() -> None:
    entries = _chain()
    forged = next_entry(entries[0], "prepared", _digest("other inputs"), {})
    entries[1] = forged
    with pytest.raises(CoopError, match="ledger seq 3: prev_hash does not link"):
        verify_ledger(entries)


def test_missing_or_reordered_entries_are_detected() -> None:
    entries = _chain()
    with pytest.raises(CoopError, match="ledger seq 3: expected seq 2"):
        verify_ledger([entries[0], *entries[2:]])
    with pytest.raises(CoopError, match="ledger seq 2: expected seq 1"):
        verify_ledger([entries[1], entries[0]])


def test_unknown_kind_and_bad_identity_are_refused() -> None:
    with pytest.raises(CoopError, match="unknown commitment kind"):
        next_entry(None, "vibes", _digest("x"), {})
    with pytest.raises(CoopError, match="not a sha256"):
        next_entry(None, "plan", "abc", {})


def test_exported_ledger_round_trips_and_is_verified(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    entries = _chain()
    path.write_bytes(msgspec.json.encode(entries))
    assert read_ledger(path) == entries
    with pytest.raises(CoopError, match="malformed"):
        decode_ledger(b'[{"seq": 1}]', "test")
