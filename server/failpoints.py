"""Named moments of the coordinator's writes at which it kills itself (SIGKILL: no cleanup, no reply), when
``COOP_FAILPOINTS`` arms them, so that a test or the chaos bench can stop it at an exact point of a write and check
that the restarted coordinator finds nothing half-done. ``COOP_FAILPOINTS=blob.installed:2`` kills it the second
time a blob's file is in place before its row is written. Unarmed (every deployment), ``reach`` is one lookup."""

from __future__ import annotations

import os
import signal

from experiment.core.errors import CoopError

POINTS = {
    "blob.received": "an upload's bytes are verified and on the disk, not yet under the blob's name",
    "blob.installed": "a blob's file is under its name, its row not yet written",
    "result.settled": "an attempt's result is recorded and its job settled, not yet committed",
    "commitment.appended": "a commitment is added to the ledger, not yet committed",
    "report.written": "the report job has written report.json in its folder, not yet stored as a blob",
    "report.stored": "the report is stored as a blob, its job not yet finished",
}

_armed: dict[str, int] = {}


def parse(spec: str) -> dict[str, int]:
    """``name:count,name:count`` (a count of 1 when left out): which points kill, on which visit."""
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition(":")
        if name not in POINTS:
            raise CoopError(f"COOP_FAILPOINTS names {name!r}, which is none of {', '.join(sorted(POINTS))}")
        if count and not (count.isdigit() and int(count) >= 1):
            raise CoopError(f"COOP_FAILPOINTS: {item!r}: the visit that kills is a whole number from 1")
        armed[name] = int(count or 1)
    return armed


def arm(armed: dict[str, int]) -> None:
    _armed.clear()
    _armed.update(armed)


def reach(name: str) -> None:
    """Die here if this point is armed and this is the visit it names."""
    if name not in _armed:
        return
    _armed[name] -= 1
    if _armed[name] == 0:
        os.kill(os.getpid(), signal.SIGKILL)
