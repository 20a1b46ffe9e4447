"""Idempotent uploads: the first response to a key is stored; a replay with the same payload gets it back,
a replay with a different payload is refused.

Two first uploads of one key may race (on Postgres the attempt row lock usually orders them, but nothing
here relies on that): the work and the stored response share one savepoint, so the loser's insert of the
key fails on its unique index, its work is rolled back, and it answers with the winner's stored reply.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.canonical import identity
from server import models
from server.httperrors import BadRequest, IdempotencyConflict


@dataclass(frozen=True)
class Stored:
    status_code: int
    body: bytes
    # True when this request replayed an earlier one (and so wrote nothing).
    replay: bool


def expected_key(job_id: object, attempt_id: object, sequence: object) -> str:
    return f"{job_id}:{attempt_id}:{sequence}"


def require_key(header: str | None, expected: str) -> str:
    if header is None:
        raise BadRequest(f"uploads need an Idempotency-Key header; this one's is {expected!r} (job:attempt:sequence)")
    if header != expected:
        raise BadRequest(f"the Idempotency-Key {header!r} does not name this upload; expected {expected!r}")
    return header


def payload_digest(payload: Any) -> str:
    """The canonical identity of the decoded payload, so key order and whitespace do not matter."""
    return identity(payload)


# The stored replies, read and written as Core statements built once: an upload makes no ORM object of its reply.
_REPLIES = models.IdempotentRequest.metadata.tables["idempotent_requests"]
_BY_KEY = select(_REPLIES.c.request_sha256, _REPLIES.c.status_code, _REPLIES.c.response).where(
    _REPLIES.c.key == bindparam("key")
)
_STORE = insert(_REPLIES)


async def stored(session: AsyncSession, key: str, request_sha256: str) -> Stored | None:
    """The stored reply for ``key``, if the same payload was accepted before (a replay)."""
    row = (await session.execute(_BY_KEY, {"key": key})).first()
    if row is None:
        return None
    if row.request_sha256 != request_sha256:
        raise IdempotencyConflict(f"Idempotency-Key {key!r} was already used with a different payload")
    return Stored(row.status_code, row.response, True)


async def once(
    session: AsyncSession, key: str, request_sha256: str, work: Callable[[], Awaitable[tuple[int, bytes]]]
) -> Stored:
    """Run ``work`` (which returns the status code and body to answer) once per key and payload."""
    previous = await stored(session, key, request_sha256)
    if previous is not None:
        return previous

    async def work_and_store() -> Stored:
        status_code, body = await work()
        reply = {"key": key, "request_sha256": request_sha256, "status_code": status_code, "response": body}
        await session.execute(_STORE, reply)
        return Stored(status_code, body, False)

    if session.get_bind().dialect.name == "sqlite":
        # The transaction has held SQLite's one write lock since its BEGIN IMMEDIATE: no other can store the key
        # between the read above and this write, so no savepoint is needed to recover from losing that race.
        return await work_and_store()
    try:
        async with session.begin_nested():
            return await work_and_store()
    except IntegrityError:
        winner = await stored(session, key, request_sha256)
        if winner is None:
            raise  # the work itself broke a constraint: not a race on the key
        return winner
