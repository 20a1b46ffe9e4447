"""The bundle's ``attempts.json``: every attempt of the experiment's train jobs, with the steps the coordinator
heard each make, from which the report counts what each fault cost (experiment.report.attempts).

Written from the coordinator's rows when the bundle is assembled, as ``ledger.json`` is. A train job's attempts
no longer change once it has succeeded (an ended attempt's late uploads are refused), and the bundle is read for
the report only after every train job has."""

from __future__ import annotations

import uuid
from collections import defaultdict

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.report.attempts import StepHeard, TrainAttempt
from server import models


async def record(session: AsyncSession, experiment_id: uuid.UUID) -> bytes:
    rows = (
        await session.execute(
            select(models.Attempt, models.Job.arm)
            .join(models.Job, models.Job.id == models.Attempt.job_id)
            .where(models.Job.experiment_id == experiment_id, models.Job.kind == "train")
        )
    ).all()
    ids = [attempt.id for attempt, _ in rows]
    events = await session.scalars(
        select(models.Event)
        .where(models.Event.attempt_id.in_(ids), models.Event.kind.in_(("started", "step")))
        .order_by(models.Event.sequence, models.Event.id)
    )
    started: dict[uuid.UUID, int] = {}
    steps: dict[uuid.UUID, list[StepHeard]] = defaultdict(list)
    for event in events:
        assert event.attempt_id is not None
        body = event.body if isinstance(event.body, dict) else {}
        if event.kind == "started" and isinstance(resumed := body.get("resumed_from_step"), int):
            started[event.attempt_id] = resumed
        elif event.kind == "step" and isinstance(step := body.get("step"), int):
            seconds = body.get("seconds")
            if isinstance(seconds, int | float):
                steps[event.attempt_id].append(StepHeard(step, float(seconds)))
    attempts = [
        TrainAttempt(
            arm=arm or "",
            generation=attempt.number,
            rank=attempt.rank,
            state=attempt.state,
            reason=attempt.reason,
            claimed_at=attempt.created_at,
            resumed_from_step=started.get(attempt.id),
            steps=sorted(steps[attempt.id], key=lambda s: s.step),
        )
        for attempt, arm in rows
    ]
    attempts.sort(key=lambda a: (a.arm, a.generation, a.rank))
    return msgspec.json.encode(attempts)
