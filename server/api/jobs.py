"""Jobs and their attempts: read, and the operator's cancel."""

from __future__ import annotations

import uuid

from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.access.tokens import Principal
from server.api import spec
from server.httperrors import NotFound
from server.protocol import actions
from server.settings import Settings
from server.store import views


async def _job(session: AsyncSession, job_id: uuid.UUID, *, lock: bool = False) -> models.Job:
    job = await session.get(models.Job, job_id, with_for_update=lock)
    if job is None:
        raise NotFound(f"job {job_id} does not exist")
    return job


class JobController(Controller):
    path = "/api/jobs"
    tags = ("jobs",)

    @get("/{job_id:uuid}", operation_id="getJob", **spec.read())
    async def get_job(self, job_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]) -> wire.Job:
        return views.job(await _job(db_session, job_id))

    @get("/{job_id:uuid}/attempts", operation_id="listAttempts", **spec.read())
    async def attempts(
        self, job_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> list[wire.Attempt]:
        await _job(db_session, job_id)
        rows = await db_session.scalars(
            select(models.Attempt)
            .where(models.Attempt.job_id == job_id)
            .order_by(models.Attempt.number, models.Attempt.rank)
        )
        return [views.attempt(row) for row in rows]

    @post("/{job_id:uuid}/cancel", operation_id="cancelJob", **spec.write("operator"))
    async def cancel(
        self,
        job_id: FromPath[uuid.UUID],
        data: JSONBody[wire.CancelRequest],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
        principal: NamedDependency[Principal],
    ) -> wire.Job:
        job = await _job(db_session, job_id, lock=True)
        await actions.cancel(db_session, settings, principal, job, data.grace_seconds)
        await db_session.flush()
        await db_session.refresh(job)
        return views.job(job)
