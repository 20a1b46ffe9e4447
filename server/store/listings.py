"""What attempts produced, as rows to filter: evaluated answers and serving phases, written once from an attempt's
result (with its measurements: server.store.measurements) and read back by the API."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import ColumnElement, func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import InstrumentedAttribute

from experiment import wire
from experiment.core import layout
from server import models
from server.dispatch.lifecycle import Refused
from server.httperrors import BadRequest
from server.settings import Settings
from server.store import blobstore, cursors, measurements

MAX_PAGE = 1000


async def record(session: AsyncSession, job: models.Job, attempt: models.Attempt, body: wire.AttemptResult) -> None:
    """Store the result's measurements, whatever its outcome (its job's kind records the rest:
    server.protocol.kinds)."""
    if len({entry.step for entry in body.journal}) != len(body.journal):
        raise BadRequest("the journal names a step twice; each update appears once")
    if body.outcome != "succeeded" and (body.answers or body.serving or body.evidence):
        raise BadRequest("answers, serving phases and evidence accompany a succeeded result only")
    now = datetime.datetime.now(datetime.UTC)
    await measurements.record_result(session, attempt, body.journal, body.resource_samples, now)


def record_serving(
    session: AsyncSession, job: models.Job, attempt: models.Attempt, phases: Sequence[wire.ServingPhase]
) -> None:
    session.add_all(
        models.ServingResult(
            experiment_id=job.experiment_id, attempt_id=attempt.id, phase=phase.phase, body=phase.report
        )
        for phase in phases
    )


async def record_answers(
    session: AsyncSession,
    settings: Settings,
    job: models.Job,
    attempt: models.Attempt,
    body: wire.AttemptResult,
    answers_sha256: str,
) -> None:
    """A succeeded evaluation's answers, checked against the answers file it names (``answers_sha256``)."""
    await _check_answers(session, settings, job, body, answers_sha256)
    if body.answers:
        await _record_answers(session, job, attempt, body.answers)


async def _check_answers(
    session: AsyncSession, settings: Settings, job: models.Job, body: wire.AttemptResult, claimed: str
) -> None:
    """An evaluation's answers are published three ways: the rows, the hash its commitment takes and the
    answers.jsonl blob the report recomputes from. They must be one record: the result names the blob as evidence,
    ``answers_sha256`` is that blob's name, and the answers sent are its lines, in order."""
    path = f"{layout.evaluation(str(job.role), str(job.arm))}/answers.jsonl"
    sha256 = body.evidence.get(path)
    if sha256 is None:
        raise BadRequest(f"an evaluate result names its answers file {path} among its evidence")
    if claimed != sha256:
        raise BadRequest(f"result.answers_sha256 {claimed!r} is not the sha256 of {path} ({sha256})")
    _, file = await blobstore.find(session, settings, sha256)
    try:
        lines = [line for line in file.read_bytes().splitlines() if line.strip()]
        recorded = [msgspec.json.decode(line, type=wire.Answer) for line in lines]
    except msgspec.MsgspecError as exc:
        raise BadRequest(f"{path} (blob {sha256}) is not a file of answers: {exc}") from None
    if len(recorded) != len(body.answers):
        raise BadRequest(f"the result sends {len(body.answers)} answers; {path} holds {len(recorded)}")
    for index, (sent, kept) in enumerate(zip(body.answers, recorded, strict=True)):
        if sent != kept:
            raise BadRequest(f"answers[{index}] (task {sent.id}) is not line {index + 1} of {path} (task {kept.id})")


async def _record_answers(
    session: AsyncSession, job: models.Job, attempt: models.Attempt, answers: Sequence[wire.Answer]
) -> None:
    if job.arm is None or job.role is None:
        raise BadRequest(f"a {job.kind} job without its arm and role reports no answers")
    if len({answer.id for answer in answers}) != len(answers):
        raise BadRequest("the answers name a task twice; each task is answered once")
    earlier = await session.scalar(
        select(models.Answer.attempt_id)
        .where(
            models.Answer.experiment_id == job.experiment_id,
            models.Answer.arm == job.arm,
            models.Answer.role == job.role,
        )
        .limit(1)
    )
    if earlier is not None:
        raise Refused(
            "answers-recorded-once",
            f"the {job.role} answers of {job.arm} are already recorded (attempt {earlier}); they are never replaced",
        )
    session.add_all(
        models.Answer(
            experiment_id=job.experiment_id,
            attempt_id=attempt.id,
            arm=job.arm,
            role=job.role,
            task_id=answer.id,
            task_index=answer.index,
            family=answer.family,
            variant=answer.variant,
            correct=answer.check.correct,
            body=msgspec.to_builtins(answer),
        )
        for answer in answers
    )


# Reads -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerFilter:
    arm: str | None = None
    role: str | None = None
    family: str | None = None
    variant: int | None = None
    correct: bool | None = None

    def conditions(self, experiment_id: uuid.UUID) -> list[ColumnElement[bool]]:
        chosen: list[tuple[InstrumentedAttribute[Any], object]] = [
            (models.Answer.arm, self.arm),
            (models.Answer.role, self.role),
            (models.Answer.family, self.family),
            (models.Answer.variant, self.variant),
            (models.Answer.correct, self.correct),
        ]
        return [models.Answer.experiment_id == experiment_id] + [
            column == value for column, value in chosen if value is not None
        ]


ANSWER_ORDER = (models.Answer.arm, models.Answer.role, models.Answer.task_index)


def recorded_answer(row: models.Answer) -> wire.RecordedAnswer:
    return wire.RecordedAnswer(
        experiment_id=row.experiment_id,
        attempt_id=row.attempt_id,
        arm=row.arm,
        role=row.role,
        answer=msgspec.convert(row.body, type=wire.Answer),
    )


async def answers(
    session: AsyncSession,
    experiment_id: uuid.UUID,
    where: AnswerFilter,
    limit: int,
    offset: int = 0,
    after: str | None = None,
) -> wire.AnswerPage:
    """A page of the answers ``where`` matches, in arm, role and task order: after the ``after`` cursor's (the API's
    pages), or from ``offset`` (the web UI's numbered pages)."""
    if not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"limit must be between 1 and {MAX_PAGE}, not {limit}")
    if offset < 0:
        raise BadRequest(f"offset must not be negative, not {offset}")
    conditions = where.conditions(experiment_id)
    total = await session.scalar(select(func.count(models.Answer.id)).where(*conditions))
    statement = select(models.Answer).where(*conditions)
    if after is not None:
        previous = await cursors.row(session, statement, models.Answer.id, after)
        before = tuple_(*ANSWER_ORDER) <= tuple_(previous.arm, previous.role, previous.task_index)
        offset = int(await session.scalar(select(func.count(models.Answer.id)).where(*conditions, before)) or 0)
    rows = list(await session.scalars(statement.order_by(*ANSWER_ORDER).offset(offset).limit(limit + 1)))
    return wire.AnswerPage(
        items=[recorded_answer(row) for row in rows[:limit]],
        total=int(total or 0),
        limit=limit,
        offset=offset,
        next=cursors.encode(rows[limit - 1].id) if len(rows) > limit else None,
    )


async def every_answer(
    session: AsyncSession, experiment_id: uuid.UUID, where: AnswerFilter
) -> list[wire.RecordedAnswer]:
    rows = await session.scalars(select(models.Answer).where(*where.conditions(experiment_id)).order_by(*ANSWER_ORDER))
    return [recorded_answer(row) for row in rows]


async def serving_results(session: AsyncSession, experiment_id: uuid.UUID) -> list[wire.ServingResult]:
    rows = await session.scalars(
        select(models.ServingResult)
        .where(models.ServingResult.experiment_id == experiment_id)
        .order_by(models.ServingResult.id)
    )
    return [
        wire.ServingResult(
            id=row.id,
            experiment_id=row.experiment_id,
            attempt_id=row.attempt_id,
            phase=row.phase,
            report=row.body,
            created_at=row.created_at,
        )
        for row in rows
    ]
