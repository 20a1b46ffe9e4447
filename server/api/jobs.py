"""Jobs and their attempts: read, and the operator's cancel."""

from __future__ import annotations

import uuid

from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.api import spec
from server.protocol import actions
from server.protocol.actions import Operator
from server.store import records, views


class JobController(Controller):
    path = "/api/jobs"
    tags = ("jobs",)

    @get("/{job_id:uuid}", operation_id="getJob", **spec.read())
    async def get_job(self, job_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]) -> wire.Job:
        return views.job(await views.found(db_session, models.Job, job_id))

    @get("/{job_id:uuid}/attempts", operation_id="listAttempts", **spec.read())
    async def attempts(
        self, job_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> list[wire.Attempt]:
        await views.found(db_session, models.Job, job_id)
        return await records.attempts(db_session, job_id)

    @post("/{job_id:uuid}/cancel", operation_id="cancelJob", **spec.write("operator"))
    async def cancel(
        self,
        job_id: FromPath[uuid.UUID],
        data: JSONBody[wire.CancelRequest],
        operator: NamedDependency[Operator],
    ) -> wire.Job:
        job = await operator.job(job_id)
        await actions.cancel(operator, job, data.grace_seconds)
        await views.fresh(operator.session, job)
        return views.job(job)
