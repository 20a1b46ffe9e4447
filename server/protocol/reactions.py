"""Every way an attempt ends, and what the coordinator does then: the one place that reacts to the queue.

The queue (queue.py) ends attempts and settles their jobs, and knows nothing else. Its ending calls (an agent's
result, a heartbeat that finds an attempt no longer held, the operator's cancel, the reaper) are made only from
here, and each passes what ended to ``_react`` in the same transaction: a job that succeeded records what its kind
commits (kinds.settle) and moves the experiment on (phases.progress, which also advances it with autopilot on). A
job whose command printed a signal may queue another (a failure-phase benchmark's replica stop: replicas.stop_due).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.dispatch import queue
from server.dispatch.queue import Ended
from server.protocol import kinds, phases, recording
from server.settings import Settings


async def _react(session: AsyncSession, settings: Settings, done: Sequence[Ended]) -> None:
    for item in done:
        if item.succeeded:
            # Under lock: two jobs of one experiment that succeed at once are settled one after the other, so the
            # second sees the first's success and the phase is found complete (on Postgres, each would otherwise
            # see the other still running, and neither would move the experiment on).
            experiment = await recording.load(session, item.job.experiment_id, lock=True)
            await kinds.settle(session, settings, experiment, item.job)
            await phases.progress(session, settings, experiment)


async def finish(
    session: AsyncSession,
    settings: Settings,
    job: models.Job,
    attempt: models.Attempt,
    ending: queue.Ending,
) -> None:
    """End an attempt as its agent (or the coordinator's report loop) reports it."""
    await _react(session, settings, [await queue.finish(session, job, attempt, ending)])


async def heartbeat(
    session: AsyncSession,
    settings: Settings,
    agent: queue.Caller,
    attempt_ids: Sequence[uuid.UUID],
    claiming: str | None = None,
) -> wire.HeartbeatReply:
    """Renew the agent's leases; an attempt it no longer holds ends lost (queue.heartbeat says which)."""
    reply, ended = await queue.heartbeat(session, settings, agent, attempt_ids, claiming)
    await _react(session, settings, ended)
    return reply


async def cancel(session: AsyncSession, settings: Settings, job: models.Job, grace_seconds: float) -> None:
    await _react(session, settings, await queue.cancel(session, job, grace_seconds))


async def reap(session: AsyncSession, settings: Settings) -> list[Ended]:
    """End expired leases and overdue cancellations; what ended."""
    ended = await queue.reap(session, settings)
    await _react(session, settings, ended)
    return ended


async def printed(session: AsyncSession, settings: Settings, owned: queue.Owned, names: set[str]) -> None:
    """The attempt ``owned`` sent events named ``names``."""
    if kinds.of(owned.kind).printed is None:
        return
    experiment = await recording.load(session, owned.experiment_id, lock=True)
    job = await session.get_one(models.Job, owned.job_id)
    order = await kinds.printed(session, job, names)
    if order is not None:
        await phases.queue(session, settings, experiment, order)
