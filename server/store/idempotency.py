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

from sqlalchemy import select
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


async def stored(session: AsyncSession, key: str, request_sha256: str) -> models.IdempotentRequest | None:
    """The stored response for ``key``, if the same payload was accepted before."""
    row = await session.scalar(
        select(models.IdempotentRequest)
        .where(models.IdempotentRequest.key == key)
        .execution_options(populate_existing=True)
    )
    if row is None:
        return None
    if row.request_sha256 != request_sha256:
        raise IdempotencyConflict(f"Idempotency-Key {key!r} was already used with a different payload")
    return row


async def once(
    session: AsyncSession, key: str, request_sha256: str, work: Callable[[], Awaitable[tuple[int, bytes]]]
) -> Stored:
    """Run ``work`` (which returns the status code and body to answer) once per key and payload."""
    previous = await stored(session, key, request_sha256)
    if previous is not None:
        return Stored(previous.status_code, previous.response, True)

    async def work_and_store() -> Stored:
        status_code, body = await work()
        session.add(
            models.IdempotentRequest(key=key, request_sha256=request_sha256, status_code=status_code, response=body)
        )
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
        return Stored(winner.status_code, winner.response, True)
