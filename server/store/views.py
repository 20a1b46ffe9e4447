"""Rows as wire Structs: the one place that turns a model into what the API returns. A row converts by its
attributes (msgspec checks every field against the wire's type); an agent's free-form labels become strings.
An experiment's plan column becomes its Plan here too."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TypeVar

import msgspec
from advanced_alchemy.base import UUIDv7AuditBase
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.plan import Plan
from server import models
from server.httperrors import NotFound

W = TypeVar("W", bound=msgspec.Struct)
R = TypeVar("R", models.Job, models.Attempt)
NAMES: dict[type[models.Job | models.Attempt], str] = {models.Job: "job", models.Attempt: "attempt"}


async def found(session: AsyncSession, model: type[R], row_id: uuid.UUID, *, lock: bool = False) -> R:
    """The job or attempt ``row_id`` (``lock``: FOR UPDATE on Postgres); 404 where there is none."""
    row = await session.get(model, row_id, with_for_update=lock)
    if row is None:
        raise NotFound(f"{NAMES[model]} {row_id} does not exist")
    return row


async def fresh(session: AsyncSession, row: UUIDv7AuditBase) -> None:
    """Write the session's changes and read ``row`` back: the database sets the audit timestamps a view shows."""
    await session.flush()
    await session.refresh(row)


_PLANS: dict[str, Plan] = {}
_PLANS_KEPT = 256


def plan_of(experiment: models.Experiment) -> Plan:
    """The experiment's frozen plan, decoded once per plan identity (a committed plan never changes)."""
    plan = _PLANS.get(experiment.plan_identity)
    if plan is None:
        if len(_PLANS) >= _PLANS_KEPT:
            _PLANS.clear()
        plan = _PLANS[experiment.plan_identity] = msgspec.convert(experiment.plan, type=Plan)
    return plan


def _converted(row: object, record: type[W]) -> W:
    return msgspec.convert(row, record, from_attributes=True)


def experiment(row: models.Experiment) -> wire.Experiment:
    return _converted(row, wire.Experiment)


def arm(row: models.Arm) -> wire.Arm:
    return _converted(row, wire.Arm)


def job(row: models.Job) -> wire.Job:
    return _converted(row, wire.Job)


def attempt(row: models.Attempt) -> wire.Attempt:
    return _converted(row, wire.Attempt)


def event(row: models.Event) -> wire.RecordedEvent:
    return _converted(row, wire.RecordedEvent)


def agent(row: models.Agent) -> wire.Agent:
    labels: Mapping[str, object] = row.labels
    return wire.Agent(
        id=row.id,
        name=row.name,
        address=row.address,
        private_address=row.private_address,
        labels={str(k): str(v) for k, v in labels.items()},
        last_seen_at=row.last_seen_at,
        created_at=row.created_at,
    )
