"""Idempotent uploads: the first response to a key is stored; a replay with the same payload gets it back,
a replay with a different payload is refused."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.canonical import identity
from server import models
from server.errors import BadRequest, IdempotencyConflict


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
    row = await session.scalar(select(models.IdempotentRequest).where(models.IdempotentRequest.key == key))
    if row is None:
        return None
    if row.request_sha256 != request_sha256:
        raise IdempotencyConflict(f"Idempotency-Key {key!r} was already used with a different payload")
    return row


def remember(session: AsyncSession, key: str, request_sha256: str, status_code: int, response: bytes) -> None:
    session.add(
        models.IdempotentRequest(key=key, request_sha256=request_sha256, status_code=status_code, response=response)
    )
