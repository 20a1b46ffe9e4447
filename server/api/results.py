"""What attempts recorded: step journals and resource samples, answers and serving results; the long listings page
with a cursor (``after=``), and answers and measurements come as CSV too, with the same filters."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import Stream
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.api import spec
from server.protocol import recording
from server.store import listings, measurements, tables, views

Cursor = Annotated[str | None, QueryParameter(max_length=64, description="the next cursor of the page before")]
MeasurementLimit = Annotated[int, QueryParameter(ge=1, le=measurements.MAX_PAGE)]
AnswerLimit = Annotated[int, QueryParameter(ge=1, le=listings.MAX_PAGE)]
Variant = Annotated[int | None, QueryParameter(ge=0, le=wire.INT32_MAX)]
CSV = "text/csv; charset=utf-8"


def answer_filter(
    role: FromQuery[wire.Role | None] = None,
    arm: FromQuery[wire.ArmName | None] = None,
    family: FromQuery[wire.Family | None] = None,
    variant: Variant = None,
    correct: FromQuery[bool | None] = None,
) -> listings.AnswerFilter:
    """The answer listings' filters, the same for the JSON pages and the CSV."""
    return listings.AnswerFilter(arm=arm, role=role, family=family, variant=variant, correct=correct)


FILTERS = {"where": Provide(answer_filter, sync_to_thread=False)}


def _csv(lines: Iterator[str], name: str) -> Stream:
    return Stream(lines, media_type=CSV, headers={"Content-Disposition": f'attachment; filename="{name}.csv"'})


class ResultController(Controller):
    path = "/api"
    tags = ("results",)

    @get("/jobs/{job_id:uuid}/measurements", operation_id="listJobMeasurements", **spec.read())
    async def job_measurements(
        self,
        job_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        kind: FromQuery[wire.MeasurementKind | None] = None,
        after: Cursor = None,
        limit: MeasurementLimit = measurements.MAX_PAGE,
    ) -> wire.MeasurementPage:
        """Every attempt's and rank's step records and resource samples, in the order recorded: a running
        attempt's as its ranks report them."""
        await views.found(db_session, models.Job, job_id)
        return await measurements.page(db_session, job_id=job_id, kind=kind, after=after, limit=limit)

    @get("/jobs/{job_id:uuid}/measurements.csv", operation_id="jobMeasurementsCsv", media_type=CSV, **spec.read())
    async def job_measurements_csv(
        self,
        job_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        kind: FromQuery[wire.MeasurementKind | None] = None,
    ) -> Stream:
        """The job's measurements as CSV: a row each, a step record's or a resource sample's columns filled."""
        await views.found(db_session, models.Job, job_id)
        every = await measurements.every(db_session, job_id=job_id, kind=kind)
        return _csv(tables.measurements(every), f"measurements-{job_id}")

    @get("/attempts/{attempt_id:uuid}/measurements", operation_id="listAttemptMeasurements", **spec.read())
    async def attempt_measurements(
        self,
        attempt_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        kind: FromQuery[wire.MeasurementKind | None] = None,
        after: Cursor = None,
        limit: MeasurementLimit = measurements.MAX_PAGE,
    ) -> wire.MeasurementPage:
        await views.found(db_session, models.Attempt, attempt_id)
        return await measurements.page(db_session, attempt_id=attempt_id, kind=kind, after=after, limit=limit)

    @get("/experiments/{experiment_id:uuid}/answers", operation_id="listAnswers", dependencies=FILTERS, **spec.read())
    async def answers(
        self,
        experiment_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        where: NamedDependency[listings.AnswerFilter],
        after: Cursor = None,
        limit: AnswerLimit = 100,
    ) -> wire.AnswerPage:
        """Every recorded answer (the protocol publishes all final-test answers), in arm, role and task order."""
        await recording.load(db_session, experiment_id)
        return await listings.answers(db_session, experiment_id, where, limit, after=after)

    @get(
        "/experiments/{experiment_id:uuid}/answers.csv",
        operation_id="answersCsv",
        media_type=CSV,
        dependencies=FILTERS,
        **spec.read(),
    )
    async def answers_csv(
        self,
        experiment_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        where: NamedDependency[listings.AnswerFilter],
    ) -> Stream:
        """Every answer the filters match, as CSV (the answer's text and check; its token ids only in the JSON)."""
        await recording.load(db_session, experiment_id)
        every = await listings.every_answer(db_session, experiment_id, where)
        return _csv(tables.answers(every), f"answers-{experiment_id}")

    @get("/experiments/{experiment_id:uuid}/serving-results", operation_id="listServingResults", **spec.read())
    async def serving_results(
        self, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> list[wire.ServingResult]:
        await recording.load(db_session, experiment_id)
        return await listings.serving_results(db_session, experiment_id)
