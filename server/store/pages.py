"""Read helpers for the experiment, job and agent pages: the summaries each shows, in a few queries."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import msgspec
from sqlalchemy import and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from experiment.core.canonical import JsonObject
from server import db, models
from server.dispatch.lifecycle import EXPERIMENT_FINAL, JOB_ACTIVE
from server.store import views

LOG_LINES = 80
LOG_CHUNK = 1000  # events of a downloaded log read at a time


def stamp(moment: datetime.datetime | None) -> str:
    """A moment as every page and log shows it: UTC, to the second."""
    return "" if moment is None else moment.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# The experiment: states, deadline and cost ------------------------------------------------------


@dataclass(frozen=True)
class StateChange:
    at: datetime.datetime
    before: str
    after: str
    reason: str


async def _state_events(session: AsyncSession, experiment_id: uuid.UUID, of_jobs: bool) -> list[models.Event]:
    """The state-change events of the experiment itself, or of its jobs (never their attempts'), oldest first."""
    rows = await session.scalars(
        select(models.Event)
        .filter_by(experiment_id=experiment_id, kind="state", attempt_id=None)
        .where(models.Event.job_id.is_not(None) if of_jobs else models.Event.job_id.is_(None))
        .order_by(models.Event.at, models.Event.id)
    )
    return list(rows)


def _change(row: models.Event) -> StateChange:
    return StateChange(row.at, *(str(row.body.get(key, "")) for key in ("from", "to", "reason")))


async def timeline(session: AsyncSession, experiment_id: uuid.UUID) -> list[StateChange]:
    """The experiment's own state changes (jobs' and attempts' carry their ids), oldest first."""
    return [_change(row) for row in await _state_events(session, experiment_id, of_jobs=False)]


@dataclass(frozen=True)
class Clock:
    """The plan's deadline and the hosts' cost so far: instance-hours since creation, times the plan's price."""

    created_at: datetime.datetime
    deadline_at: datetime.datetime
    # When the experiment reached a final state; the meter stops there.
    ended_at: datetime.datetime | None
    hosts: int
    price_per_instance_hour: float
    budget_ceiling: float
    instance_type: str
    at: datetime.datetime = field(default_factory=_now)

    @property
    def remaining_seconds(self) -> float:
        return (self.deadline_at - (self.ended_at or self.at)).total_seconds()

    @property
    def instance_hours(self) -> float:
        return self.hosts * ((self.ended_at or self.at) - self.created_at).total_seconds() / 3600

    @property
    def cost(self) -> float | None:
        """None where the plan prices the hosts at nothing (the local plan)."""
        return self.instance_hours * self.price_per_instance_hour if self.price_per_instance_hour > 0 else None


def clock(experiment: models.Experiment, changes: Sequence[StateChange]) -> Clock:
    plan = views.plan_of(experiment)
    final = experiment.state in EXPERIMENT_FINAL
    return Clock(
        created_at=experiment.created_at,
        deadline_at=experiment.created_at + datetime.timedelta(hours=plan.training.deadline_hours),
        ended_at=changes[-1].at if final and changes else None,
        hosts=plan.hosts.count,
        price_per_instance_hour=plan.hosts.price_per_instance_hour,
        budget_ceiling=plan.hosts.budget_ceiling,
        instance_type=plan.hosts.instance_type,
    )


async def experiment_list(session: AsyncSession) -> list[models.Experiment]:
    return list(await session.scalars(select(models.Experiment).order_by(models.Experiment.id.desc())))


# Jobs, attempts and their logs ---------------------------------------------------------------------


async def jobs(session: AsyncSession, experiment_id: uuid.UUID) -> list[models.Job]:
    return list(
        await session.scalars(
            select(models.Job)
            .where(models.Job.experiment_id == experiment_id)
            .order_by(models.Job.queued_at, models.Job.id)
        )
    )


COORDINATOR = "coordinator"  # the host of an attempt without an agent: the coordinator's own job (the report)


@dataclass(frozen=True)
class AttemptRow:
    attempt: models.Attempt
    agent: str  # the agent's name, or COORDINATOR

    @property
    def active(self) -> bool:
        return self.attempt.state in JOB_ACTIVE


async def attempts(session: AsyncSession, job_id: uuid.UUID) -> list[AttemptRow]:
    rows = await session.execute(
        select(models.Attempt, models.Agent.name)
        .outerjoin(models.Agent, models.Agent.id == models.Attempt.agent_id)
        .where(models.Attempt.job_id == job_id)
        .order_by(models.Attempt.number.desc(), models.Attempt.rank)
    )
    return [AttemptRow(attempt, name or COORDINATOR) for attempt, name in rows]


async def experiment_attempts(session: AsyncSession, experiment_id: uuid.UUID) -> list[AttemptRow]:
    """Every attempt of the experiment's jobs with its agent's name, in the order they were claimed."""
    rows = await session.execute(
        select(models.Attempt, models.Agent.name)
        .outerjoin(models.Agent, models.Agent.id == models.Attempt.agent_id)
        .join(models.Job, models.Job.id == models.Attempt.job_id)
        .where(models.Job.experiment_id == experiment_id)
        .order_by(models.Attempt.created_at, models.Attempt.rank)
    )
    return [AttemptRow(attempt, name or COORDINATOR) for attempt, name in rows]


async def job_changes(session: AsyncSession, experiment_id: uuid.UUID) -> dict[uuid.UUID, list[StateChange]]:
    """Job -> its own state changes (not its attempts'), oldest first."""
    found: dict[uuid.UUID, list[StateChange]] = {}
    for row in await _state_events(session, experiment_id, of_jobs=True):
        if row.job_id is not None:  # always, by the query; the check narrows the column's type
            found.setdefault(row.job_id, []).append(_change(row))
    return found


@dataclass(frozen=True)
class LogLine:
    at: datetime.datetime
    kind: str
    text: str

    @property
    def printed(self) -> str:
        """The line as the job page shows it and the downloaded log holds it."""
        return f"{stamp(self.at)} {self.kind:<10} {self.text}"


def _fields(body: JsonObject) -> str:
    return msgspec.json.encode({k: v for k, v in body.items() if k != "event"}).decode()


# How the log shows an event, by its kind: a line the command printed, a state change, else its fields.
_LINES: dict[str, Callable[[JsonObject], str]] = {
    "output": lambda body: str(body.get("line", "")),
    "state": lambda body: f"{body.get('from')} -> {body.get('to')}: {body.get('reason')}",
}


def _line(event: models.Event) -> str:
    return _LINES.get(event.kind, _fields)(event.body)


async def log_tail(session: AsyncSession, attempt_id: uuid.UUID, lines: int = LOG_LINES) -> list[LogLine]:
    """The attempt's last events (its command's output and its state changes), oldest first."""
    rows = await session.scalars(
        select(models.Event)
        .where(models.Event.attempt_id == attempt_id)
        .order_by(models.Event.at.desc(), models.Event.id.desc())
        .limit(lines)
    )
    return [LogLine(row.at, row.kind, _line(row)) for row in reversed(list(rows))]


async def log(sessions: async_sessionmaker[AsyncSession], attempt_id: uuid.UUID) -> AsyncIterator[bytes]:
    """Every event of the attempt, oldest first, in the tail's order (the whole log the tail ends), as text read
    ``LOG_CHUNK`` events at a time, each chunk in a read of its own: however long the log, the coordinator holds one
    chunk of it, and no read transaction stays open while a slow client downloads."""
    order = (models.Event.at, models.Event.id)
    last: tuple[datetime.datetime, uuid.UUID] | None = None
    while True:
        listing = select(models.Event).where(models.Event.attempt_id == attempt_id)
        if last is not None:
            at, event_id = last
            listing = listing.where(or_(models.Event.at > at, and_(models.Event.at == at, models.Event.id > event_id)))
        async with sessions() as session:
            db.reading(session)
            rows = list(await session.scalars(listing.order_by(*order).limit(LOG_CHUNK)))
        if not rows:
            return
        yield "".join(f"{LogLine(row.at, row.kind, _line(row)).printed}\n" for row in rows).encode()
        if len(rows) < LOG_CHUNK:
            return
        last = rows[-1].at, rows[-1].id


async def log_size(session: AsyncSession, attempt_id: uuid.UUID) -> int:
    counted = await session.scalar(select(func.count(models.Event.id)).where(models.Event.attempt_id == attempt_id))
    return int(counted or 0)


# Agents ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentRow:
    agent: models.Agent
    running: list[tuple[models.Attempt, models.Job]]


async def agents(session: AsyncSession) -> list[AgentRow]:
    rows = list(await session.scalars(select(models.Agent).order_by(models.Agent.name)))
    active = await session.execute(
        select(models.Attempt, models.Job)
        .join(models.Job, models.Job.id == models.Attempt.job_id)
        .where(models.Attempt.state.in_(list(JOB_ACTIVE)))
        .order_by(models.Attempt.created_at)
    )
    running: dict[uuid.UUID, list[tuple[models.Attempt, models.Job]]] = {}
    for attempt_row, job_row in active:
        if attempt_row.agent_id is not None:
            running.setdefault(attempt_row.agent_id, []).append((attempt_row, job_row))
    return [AgentRow(row, running.get(row.id, [])) for row in rows]
