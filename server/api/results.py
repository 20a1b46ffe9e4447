"""What attempts recorded: step journals and resource samples, answers and serving results."""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import experiments, models, results
from server.api import spec
from server.errors import NotFound


class ResultController(Controller):
    path = "/api"
    tags = ("results",)

    @get("/jobs/{job_id:uuid}/measurements", operation_id="listJobMeasurements", **spec.read())
    async def job_measurements(
        self,
        job_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        kind: FromQuery[wire.MeasurementKind | None] = None,
    ) -> list[wire.Measurement]:
        """Every attempt's and rank's step journal and resource samples, in attempt, rank and step order."""
        if await db_session.get(models.Job, job_id) is None:
            raise NotFound(f"job {job_id} does not exist")
        return await results.measurements(db_session, job_id=job_id, kind=kind)

    @get("/attempts/{attempt_id:uuid}/measurements", operation_id="listAttemptMeasurements", **spec.read())
    async def attempt_measurements(
        self,
        attempt_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        kind: FromQuery[wire.MeasurementKind | None] = None,
    ) -> list[wire.Measurement]:
        if await db_session.get(models.Attempt, attempt_id) is None:
            raise NotFound(f"attempt {attempt_id} does not exist")
        return await results.measurements(db_session, attempt_id=attempt_id, kind=kind)

    @get("/experiments/{experiment_id:uuid}/answers", operation_id="listAnswers", **spec.read())
    async def answers(
        self,
        experiment_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        role: FromQuery[wire.Role | None] = None,
        arm: FromQuery[wire.ArmName | None] = None,
        family: FromQuery[wire.Family | None] = None,
        variant: Annotated[int | None, QueryParameter(ge=0, le=wire.INT32_MAX)] = None,
        correct: FromQuery[bool | None] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=results.MAX_PAGE)] = 100,
        offset: Annotated[int, QueryParameter(ge=0, le=wire.INT32_MAX)] = 0,
    ) -> wire.AnswerPage:
        """Every recorded answer (the protocol publishes all final-test answers), in task order, paginated."""
        await experiments.load(db_session, experiment_id)
        where = results.AnswerFilter(arm=arm, role=role, family=family, variant=variant, correct=correct)
        return await results.answers(db_session, experiment_id, where, limit, offset)

    @get("/experiments/{experiment_id:uuid}/serving-results", operation_id="listServingResults", **spec.read())
    async def serving_results(
        self, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> list[wire.ServingResult]:
        await experiments.load(db_session, experiment_id)
        return await results.serving_results(db_session, experiment_id)
