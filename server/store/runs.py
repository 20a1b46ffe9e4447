"""What the training and resources pages read of an experiment's runs: each arm's train job and the jobs' attempts,
the attempts' ``step`` rows (live events and the step journal), and the attempts that recorded samples of one kind
with those samples."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.canonical import Json, JsonObject
from server import models
from server.store.pages import COORDINATOR


async def train_jobs(session: AsyncSession, experiment_id: uuid.UUID) -> dict[str | None, models.Job]:
    """The experiment's train job per arm (the last queued, should an arm have had more than one)."""
    return {
        job.arm: job
        for job in await session.scalars(
            select(models.Job)
            .filter_by(experiment_id=experiment_id, kind="train")
            .order_by(models.Job.queued_at, models.Job.id)
        )
    }


async def attempts_of(session: AsyncSession, job_ids: Sequence[uuid.UUID]) -> list[models.Attempt]:
    """The jobs' attempts, by generation and then rank."""
    return list(
        await session.scalars(
            select(models.Attempt)
            .where(models.Attempt.job_id.in_(job_ids))
            .order_by(models.Attempt.number, models.Attempt.rank)
        )
    )


async def step_rows(
    session: AsyncSession, model: type[models.Event] | type[models.Measurement], attempt_ids: Sequence[uuid.UUID]
) -> Sequence[tuple[uuid.UUID | None, datetime.datetime, JsonObject]]:
    """The attempts' ``step`` rows of ``model``: their attempt, time and body."""
    statement = select(model.attempt_id, model.at, model.body).where(model.attempt_id.in_(attempt_ids))
    return (await session.execute(statement.filter_by(kind="step"))).tuples().all()


async def sampled(
    session: AsyncSession, experiment_id: uuid.UUID, kind: str
) -> list[tuple[models.Attempt, models.Job, str]]:
    """Every attempt of the experiment that recorded measurements of ``kind``, in claim order, with its job and its
    host (its agent's name, or COORDINATOR)."""
    with_samples = select(models.Measurement.attempt_id).where(models.Measurement.kind == kind).distinct()
    rows = await session.execute(
        select(models.Attempt, models.Job, models.Agent.name)
        .join(models.Job, models.Job.id == models.Attempt.job_id)
        .outerjoin(models.Agent, models.Agent.id == models.Attempt.agent_id)
        .where(models.Job.experiment_id == experiment_id, models.Attempt.id.in_(with_samples))
        .order_by(models.Attempt.created_at, models.Attempt.rank)
    )
    return [(attempt, job, name or COORDINATOR) for attempt, job, name in rows]


async def samples(
    session: AsyncSession, kind: str, attempt_ids: Sequence[uuid.UUID]
) -> Sequence[tuple[uuid.UUID, Json]]:
    """The attempts' measurements of ``kind``: their attempt and body, each attempt's in the order taken."""
    rows = await session.execute(
        select(models.Measurement.attempt_id, models.Measurement.body)
        .where(models.Measurement.kind == kind, models.Measurement.attempt_id.in_(attempt_ids))
        .order_by(models.Measurement.attempt_id, models.Measurement.position)
    )
    return rows.tuples().all()
