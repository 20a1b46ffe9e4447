"""Train ranks' step records and resource samples as rows: recorded from a rank's events while it runs, completed
from its result with what the events did not carry, and read back in pages in the order they were recorded."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
from sqlalchemy import ColumnElement, and_, insert, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.canonical import JsonObject
from server import models
from server.httperrors import BadRequest
from server.store import cursors

MAX_PAGE = 10_000
STEP_FIELDS = wire.StepRecord.__struct_fields__
SAMPLE_FIELDS = wire.ResourceSample.__struct_fields__
MEASUREMENTS = insert(models.Measurement.metadata.tables["measurements"])


class _Carried(NamedTuple):
    kind: str
    position: int
    step: int | None
    at: datetime.datetime
    body: JsonObject


def _row(event: wire.Event, received: datetime.datetime) -> _Carried | None:
    """The measurement a ``step`` or ``resources`` event carries; None for any other event, or one that carries
    none (a command's own progress line of the same name)."""
    body, at = event.body, event.at or received
    try:
        if event.kind == "step":
            entry = msgspec.convert({k: v for k, v in body.items() if k in STEP_FIELDS}, type=wire.StepRecord)
            return _Carried("step", entry.step, entry.step, at, _builtins(entry))
        if event.kind == "resources":
            sample = msgspec.convert({k: v for k, v in body.items() if k in SAMPLE_FIELDS}, type=wire.ResourceSample)
            index, step = msgspec.convert([body.get("index"), body.get("step")], type=tuple[wire.Count, wire.Step])
            return _Carried("resources", index, step, at, _builtins(sample))
    except msgspec.ValidationError:
        return None
    return None


def _builtins(value: wire.StepRecord | wire.ResourceSample) -> JsonObject:
    built: JsonObject = msgspec.to_builtins(value)
    return built


async def _recorded(session: AsyncSession, attempt: models.Attempt) -> dict[tuple[str, int], models.Measurement]:
    rows = await session.scalars(select(models.Measurement).where(models.Measurement.attempt_id == attempt.id))
    return {(row.kind, row.position): row for row in rows}


async def record_events(
    session: AsyncSession, attempt_id: uuid.UUID, events: Sequence[wire.Event], received: datetime.datetime
) -> None:
    """The measurements a batch of the attempt's events carries, each once (a repeated one is not recorded again):
    one read of those of the batch's positions already recorded, and one INSERT of the rest."""
    found = [row for event in events if (row := _row(event, received)) is not None]
    if not found:
        return
    positions: dict[str, list[int]] = {}
    for row in found:
        positions.setdefault(row.kind, []).append(row.position)
    table = models.Measurement
    earlier = await session.execute(
        select(table.kind, table.position).where(
            table.attempt_id == attempt_id,
            or_(*(and_(table.kind == kind, table.position.in_(chosen)) for kind, chosen in positions.items())),
        )
    )
    recorded = {(kind, position) for kind, position in earlier}
    new = []
    for row in found:
        if (row.kind, row.position) not in recorded:
            recorded.add((row.kind, row.position))
            new.append({**row._asdict(), "attempt_id": attempt_id})
    if new:
        await session.execute(MEASUREMENTS, new)


async def record_result(
    session: AsyncSession,
    attempt: models.Attempt,
    journal: Sequence[wire.StepRecord],
    samples: Sequence[wire.ResourceSample],
    received: datetime.datetime,
) -> None:
    """The result's journal and samples: those the events carried must be the same, the others are recorded now."""
    recorded = await _recorded(session, attempt)
    carried: list[tuple[str, int, int | None, JsonObject]] = [
        ("step", entry.step, entry.step, _builtins(entry)) for entry in sorted(journal, key=lambda e: e.step)
    ]
    carried += [("resources", index, None, _builtins(sample)) for index, sample in enumerate(samples)]
    for kind, position, step, body in carried:
        earlier = recorded.get((kind, position))
        if earlier is None:
            session.add(
                models.Measurement(
                    attempt_id=attempt.id, kind=kind, position=position, step=step, at=received, body=body
                )
            )
        elif earlier.body != body:
            raise BadRequest(f"the result's {kind} {position} differs from the one its events reported")


def _listing(job_id: uuid.UUID | None, attempt_id: uuid.UUID | None, kind: str | None) -> list[ColumnElement[bool]]:
    chosen: list[ColumnElement[bool]] = []
    if job_id is not None:
        chosen.append(models.Attempt.job_id == job_id)
    if attempt_id is not None:
        chosen.append(models.Measurement.attempt_id == attempt_id)
    if kind is not None:
        chosen.append(models.Measurement.kind == kind)
    return chosen


def view(row: models.Measurement, attempt: models.Attempt) -> wire.Measurement:
    if row.kind == "step":
        return wire.StepMeasurement(
            attempt_id=attempt.id,
            number=attempt.number,
            rank=attempt.rank,
            step=row.position,
            at=row.at,
            record=msgspec.convert(row.body, type=wire.StepRecord),
        )
    return wire.ResourceMeasurement(
        attempt_id=attempt.id,
        number=attempt.number,
        rank=attempt.rank,
        index=row.position,
        step=row.step,
        at=row.at,
        sample=msgspec.convert(row.body, type=wire.ResourceSample),
    )


async def page(
    session: AsyncSession,
    *,
    job_id: uuid.UUID | None = None,
    attempt_id: uuid.UUID | None = None,
    kind: str | None = None,
    after: str | None = None,
    limit: int = MAX_PAGE,
) -> wire.MeasurementPage:
    """A job's (every attempt and rank) or one attempt's measurements, in the order they were recorded."""
    listing = _listing(job_id, attempt_id, kind)
    joined = select(models.Measurement).join(models.Attempt, models.Attempt.id == models.Measurement.attempt_id)
    statement = (
        select(models.Measurement, models.Attempt)
        .join(models.Attempt, models.Attempt.id == models.Measurement.attempt_id)
        .where(*listing)
    )
    if after is not None:
        previous = await cursors.row(session, joined.where(*listing), models.Measurement.id, after)
        statement = statement.where(models.Measurement.id > previous.id)
    rows = list(await session.execute(statement.order_by(models.Measurement.id).limit(limit + 1)))
    return wire.MeasurementPage(
        items=[view(row, attempt) for row, attempt in rows[:limit]],
        next=cursors.encode(rows[limit - 1][0].id) if len(rows) > limit else None,
    )


async def every(
    session: AsyncSession, *, job_id: uuid.UUID | None = None, kind: str | None = None
) -> list[wire.Measurement]:
    """All of a job's measurements ``kind`` matches, in the order recorded."""
    rows = await session.execute(
        select(models.Measurement, models.Attempt)
        .join(models.Attempt, models.Attempt.id == models.Measurement.attempt_id)
        .where(*_listing(job_id, None, kind))
        .order_by(models.Measurement.id)
    )
    return [view(row, attempt) for row, attempt in rows]
