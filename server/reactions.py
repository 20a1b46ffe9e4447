"""What the coordinator does when attempts end or their commands print: the one place that reacts to the queue.

The queue (queue.py) ends attempts and settles their jobs, and knows nothing else; each call that ends something
returns it (``queue.Ended``) and its caller hands that here, in the same transaction. A job that succeeded records
what its kind commits (kinds.settle) and lets autopilot advance the experiment (phases.autopilot); a job whose
command printed a signal may queue another (a failure-phase benchmark's replica stop: serving.stop_due).
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncSession

from server import experiments, kinds, models, phases
from server.queue import Ended
from server.settings import Settings


async def ended(session: AsyncSession, settings: Settings, done: Sequence[Ended]) -> None:
    for item in done:
        if item.succeeded:
            await kinds.settle(session, settings, item.job)
            await phases.autopilot(session, settings, await experiments.load(session, item.job.experiment_id))


async def printed(session: AsyncSession, settings: Settings, job: models.Job, names: set[str]) -> None:
    """The attempt of ``job`` sent events named ``names``."""
    if kinds.of(job.kind).printed is None:
        return
    experiment = await experiments.load(session, job.experiment_id, lock=True)
    order = await kinds.printed(session, job, names)
    if order is not None:
        await kinds.enqueue(session, settings, experiment, order)
