"""Rows as wire Structs: the one place that turns a model into what the API returns. A row converts by its
attributes (msgspec checks every field against the wire's type); an agent's free-form labels become strings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import msgspec

from experiment import wire
from server import models

W = TypeVar("W", bound=msgspec.Struct)


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
