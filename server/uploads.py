"""Event batches and results from agents, each idempotent under its Idempotency-Key."""

from __future__ import annotations

import datetime
import uuid

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import failpoints
from server.dispatch import lifecycle, queue
from server.protocol import kinds, reactions
from server.settings import Settings
from server.store import evidencefiles, idempotency, measurements, views
from server.store.idempotency import Stored


async def events(
    session: AsyncSession,
    settings: Settings,
    agent: queue.Caller,
    attempt_id: uuid.UUID,
    body: wire.EventBatch,
    key: str | None,
) -> Stored:
    owned = await queue.owned_row(session, agent, attempt_id, body.lease_token)
    checked = idempotency.require_key(key, idempotency.expected_key(owned.job_id, owned.attempt_id, body.sequence))

    async def work() -> tuple[int, bytes]:
        queue.require_active(owned)  # an ended attempt's command is gone: what it printed late is not its record
        await reactions.printed(session, settings, owned, {event.kind for event in body.events})
        received = datetime.datetime.now(datetime.UTC)
        # One INSERT of every row, as a Core statement on the table: no ORM object each (a batch holds up to 10,000
        # events), and none of the ORM's bulk-insert bookkeeping, a third of a batch's CPU.
        await session.execute(
            lifecycle.NEW_EVENT,
            [
                {
                    "experiment_id": owned.experiment_id,
                    "job_id": owned.job_id,
                    "attempt_id": owned.attempt_id,
                    "sequence": body.sequence,
                    "kind": event.kind,
                    "at": event.at or received,
                    "body": event.body,
                }
                for event in body.events
            ],
        )
        await measurements.record_events(session, owned.attempt_id, body.events, received)
        return 201, msgspec.json.encode(wire.EventBatchReply(owned.attempt_id, body.sequence, len(body.events)))

    return await idempotency.once(session, checked, idempotency.payload_digest(msgspec.to_builtins(body)), work)


async def result(
    session: AsyncSession,
    settings: Settings,
    agent: queue.Caller,
    attempt_id: uuid.UUID,
    body: wire.AttemptResult,
    key: str | None,
) -> Stored:
    """Record what the attempt measured and produced, then end it (which may advance the experiment)."""
    job, attempt = await queue.owned_attempt(session, agent, attempt_id, body.lease_token)
    checked = idempotency.require_key(key, idempotency.expected_key(job.id, attempt.id, "result"))

    async def work() -> tuple[int, bytes]:
        queue.require_active(attempt)
        result = await kinds.record_result(session, settings, job, attempt, body)
        if body.evidence:
            await evidencefiles.record(session, job, attempt, body.evidence, kinds.of(job.kind).writes(job, attempt))
        ending = queue.Ending(body.outcome, body.exit_code, body.reason, result)
        await reactions.finish(session, settings, job, attempt, ending)
        await session.flush()
        failpoints.reach("result.settled")
        return 200, msgspec.json.encode(views.attempt(attempt))

    return await idempotency.once(session, checked, idempotency.payload_digest(msgspec.to_builtins(body)), work)
