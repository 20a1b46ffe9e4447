"""The agent's local spool (SQLite under the work dir): every event batch and result is written here before it
is sent and kept until the coordinator acknowledges it, so that nothing is lost while the coordinator is
unreachable or the agent restarts. Uploads replay in the order they were spooled, under the same keys. It also
records the process groups the agent started, so that a restarted agent can end those an earlier run left."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from experiment import wire

UploadKind = Literal["events", "blob", "result"]
BLOB_PREFIX = "blob-"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS uploads (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    attempt_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    key TEXT NOT NULL UNIQUE,
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',  -- pending | acknowledged | rejected
    note TEXT
);
CREATE TABLE IF NOT EXISTS attempts (
    attempt_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    lease_token TEXT NOT NULL,
    next_sequence INTEGER NOT NULL DEFAULT 0,
    finished INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS process_groups (
    pid INTEGER PRIMARY KEY,  -- the leader's pid, which is also the group's id
    started REAL NOT NULL,  -- the leader's create time (psutil): a recycled pid is never taken for the leader
    marker TEXT NOT NULL,  -- in the environment of every process of the group, and of those that left it
    what TEXT NOT NULL,
    attempt_id TEXT  -- the attempt whose command it is; NULL for a service
);
"""


@dataclass(frozen=True)
class Upload:
    id: int
    attempt_id: uuid.UUID
    kind: UploadKind
    key: str
    body: bytes


@dataclass(frozen=True)
class OpenAttempt:
    """An attempt this agent started and has not yet spooled a result for."""

    attempt_id: uuid.UUID
    job_id: uuid.UUID
    lease_token: str


@dataclass(frozen=True)
class Group:
    """A process group the agent started (agent.processes), recorded until it has ended."""

    pid: int
    started: float
    marker: str
    what: str
    attempt_id: uuid.UUID | None = None


class Spool:
    """Thread-safe: the supervisor writes, the sender drains, one connection behind a lock."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self.changed = threading.Event()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def open_attempt(self, attempt_id: uuid.UUID, job_id: uuid.UUID, lease_token: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO attempts (attempt_id, job_id, lease_token) VALUES (?, ?, ?)",
                (str(attempt_id), str(job_id), lease_token),
            )

    def unfinished(self) -> list[OpenAttempt]:
        with self._lock:
            rows = self._db.execute(
                "SELECT attempt_id, job_id, lease_token FROM attempts WHERE finished = 0 ORDER BY rowid"
            ).fetchall()
        return [OpenAttempt(uuid.UUID(a), uuid.UUID(j), t) for a, j, t in rows]

    def add_events(self, attempt: OpenAttempt, events: list[wire.Event]) -> int:
        """Spool one batch under the attempt's next sequence number; returns that number."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            (sequence,) = self._db.execute(
                "SELECT next_sequence FROM attempts WHERE attempt_id = ?", (str(attempt.attempt_id),)
            ).fetchone()
            batch = wire.EventBatch(lease_token=attempt.lease_token, sequence=sequence, events=events)
            self._insert(attempt, "events", str(sequence), msgspec.json.encode(batch))
            self._db.execute(
                "UPDATE attempts SET next_sequence = ? WHERE attempt_id = ?", (sequence + 1, str(attempt.attempt_id))
            )
        self.changed.set()
        return int(sequence)

    def add_result(
        self, attempt: OpenAttempt, result: wire.AttemptResult, blobs: dict[str, bytes] | None = None
    ) -> None:
        """Spool the evidence blobs the result names, then the result (after every batch of the attempt),
        and close the attempt."""
        with self._lock, self._db:
            self._db.execute("BEGIN IMMEDIATE")
            for sha256, data in sorted((blobs or {}).items()):
                self._insert(attempt, "blob", f"{BLOB_PREFIX}{sha256}", data)
            self._insert(attempt, "result", "result", msgspec.json.encode(result))
            self._db.execute("UPDATE attempts SET finished = 1 WHERE attempt_id = ?", (str(attempt.attempt_id),))
        self.changed.set()

    def _insert(self, attempt: OpenAttempt, kind: UploadKind, sequence: str, body: bytes) -> None:
        key = f"{attempt.job_id}:{attempt.attempt_id}:{sequence}"
        self._db.execute(
            "INSERT INTO uploads (attempt_id, kind, key, body) VALUES (?, ?, ?, ?)",
            (str(attempt.attempt_id), kind, key, body),
        )

    def pending(self, limit: int = 100) -> list[Upload]:
        with self._lock:
            rows = self._db.execute(
                "SELECT id, attempt_id, kind, key, body FROM uploads WHERE state = 'pending' ORDER BY id LIMIT ?",
                (limit,),
            ).fetchall()
        return [Upload(i, uuid.UUID(a), k, key, bytes(b)) for i, a, k, key, b in rows]

    def settle(self, upload: Upload, state: Literal["acknowledged", "rejected"], note: str | None = None) -> None:
        with self._lock:
            self._db.execute("UPDATE uploads SET state = ?, note = ? WHERE id = ?", (state, note, upload.id))

    def undelivered(self) -> list[uuid.UUID]:
        """The attempts whose result is spooled and not yet settled with the coordinator."""
        with self._lock:
            rows = self._db.execute(
                "SELECT attempt_id FROM uploads WHERE kind = 'result' AND state = 'pending' ORDER BY id"
            ).fetchall()
        return [uuid.UUID(a) for (a,) in rows]

    def record_group(self, group: Group) -> None:
        attempt_id = None if group.attempt_id is None else str(group.attempt_id)
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO process_groups (pid, started, marker, what, attempt_id) VALUES (?, ?, ?, ?, ?)",
                (group.pid, group.started, group.marker, group.what, attempt_id),
            )

    def forget_group(self, group: Group) -> None:
        with self._lock:
            self._db.execute("DELETE FROM process_groups WHERE pid = ? AND started = ?", (group.pid, group.started))

    def groups(self) -> list[Group]:
        with self._lock:
            rows = self._db.execute(
                "SELECT pid, started, marker, what, attempt_id FROM process_groups ORDER BY rowid"
            ).fetchall()
        return [Group(int(p), float(s), m, w, None if a is None else uuid.UUID(a)) for p, s, m, w, a in rows]

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM uploads GROUP BY state").fetchall()
        return {state: int(count) for state, count in rows}
