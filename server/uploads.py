"""Event batches and results from agents, each idempotent under its Idempotency-Key."""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import idempotency, models, queue, views
from server.settings import Settings


@dataclass(frozen=True)
class Stored:
    status_code: int
    body: bytes
    replay: bool


async def events(
    session: AsyncSession, agent: models.Agent, attempt_id: uuid.UUID, body: wire.EventBatch, key: str | None
) -> Stored:
    job, attempt = await queue.owned_attempt(session, agent, attempt_id, body.lease_token)
    checked = idempotency.require_key(key, idempotency.expected_key(job.id, attempt.id, body.sequence))
    digest = idempotency.payload_digest(msgspec.to_builtins(body))
    previous = await idempotency.stored(session, checked, digest)
    if previous is not None:
        return Stored(previous.status_code, previous.response, True)
    received = datetime.datetime.now(datetime.UTC)
    session.add_all(
        models.Event(
            experiment_id=job.experiment_id,
            job_id=job.id,
            attempt_id=attempt.id,
            sequence=body.sequence,
            kind=event.kind,
            at=event.at or received,
            body=event.body,
        )
        for event in body.events
    )
    reply = msgspec.json.encode(wire.EventBatchReply(attempt.id, body.sequence, len(body.events)))
    idempotency.remember(session, checked, digest, 201, reply)
    return Stored(201, reply, False)


async def result(
    session: AsyncSession,
    settings: Settings,
    agent: models.Agent,
    attempt_id: uuid.UUID,
    body: wire.AttemptResult,
    key: str | None,
) -> Stored:
    job, attempt = await queue.owned_attempt(session, agent, attempt_id, body.lease_token)
    checked = idempotency.require_key(key, idempotency.expected_key(job.id, attempt.id, "result"))
    digest = idempotency.payload_digest(msgspec.to_builtins(body))
    previous = await idempotency.stored(session, checked, digest)
    if previous is not None:
        return Stored(previous.status_code, previous.response, True)
    finished = await queue.finish(session, settings, job, attempt, body)
    await session.flush()
    reply = msgspec.json.encode(views.attempt(finished))
    idempotency.remember(session, checked, digest, 200, reply)
    return Stored(200, reply, False)
