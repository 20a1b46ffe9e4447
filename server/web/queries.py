"""Read helpers for the UI: the summaries a page shows, each from the coordinator's rows in a few queries."""

from __future__ import annotations

import datetime
import statistics
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from sqlalchemy import case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import blobs, evidence, experiments, models
from server.errors import NotFound
from server.lifecycle import EVALUATED_ARMS, EXPERIMENT_FINAL, JOB_ACTIVE, TRAINED_ARMS, ExperimentState, JobState
from server.settings import Settings

LOG_LINES = 80


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


# The experiment: states, deadline and cost ------------------------------------------------------


@dataclass(frozen=True)
class StateChange:
    at: datetime.datetime
    before: str
    after: str
    reason: str


async def timeline(session: AsyncSession, experiment_id: uuid.UUID) -> list[StateChange]:
    """The experiment's own state changes (jobs' and attempts' carry their ids), oldest first."""
    rows = await session.scalars(
        select(models.Event)
        .where(
            models.Event.experiment_id == experiment_id,
            models.Event.kind == "state",
            models.Event.job_id.is_(None),
            models.Event.attempt_id.is_(None),
        )
        .order_by(models.Event.at, models.Event.id)
    )
    return [
        StateChange(row.at, str(row.body.get("from", "")), str(row.body.get("to", "")), str(row.body.get("reason", "")))
        for row in rows
    ]


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
    plan = experiments.plan_of(experiment)
    final = ExperimentState(experiment.state) in EXPERIMENT_FINAL
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


# Training progress -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    step: int
    loss: float
    seconds: float
    at: datetime.datetime


@dataclass(frozen=True)
class RankProgress:
    rank: int
    attempt: int
    state: str
    done: int
    total: int
    updated_at: datetime.datetime | None
    median_seconds: float | None

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 0.0


@dataclass(frozen=True)
class ArmProgress:
    name: str
    world_size: int
    job: models.Job | None
    ranks: list[RankProgress]
    final_step: int | None
    model_identity: str | None
    # Rank 0's loss per update; a retry's steps replace the earlier generation's.
    losses: list[tuple[int, float]]


def _step(body: dict[str, Any], at: datetime.datetime, key: str) -> Step | None:
    try:
        return Step(int(body[key]), float(body["loss"]), float(body["seconds"]), at)
    except (KeyError, TypeError, ValueError):
        return None  # an event from another command version: progress shows what it can


async def _steps(session: AsyncSession, attempt_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, dict[int, Step]]:
    """Per attempt, its updates: the live ``step`` events, completed by the step journal of its result."""
    found: dict[uuid.UUID, dict[int, Step]] = {attempt_id: {} for attempt_id in attempt_ids}
    events = await session.execute(
        select(models.Event.attempt_id, models.Event.at, models.Event.body).where(
            models.Event.attempt_id.in_(attempt_ids), models.Event.kind == "step"
        )
    )
    for attempt_id, at, body in events.tuples():
        step = _step(body, at, "done")
        if attempt_id is not None and step is not None:
            found[attempt_id][step.step] = step
    journal = await session.execute(
        select(models.Measurement.attempt_id, models.Measurement.at, models.Measurement.body).where(
            models.Measurement.attempt_id.in_(attempt_ids), models.Measurement.kind == "step"
        )
    )
    for attempt_id, at, body in journal.tuples():
        step = _step(body, at, "step")
        if step is not None:
            found[attempt_id].setdefault(step.step, step)
    return found


async def training(session: AsyncSession, experiment: models.Experiment) -> list[ArmProgress]:
    updates = experiments.plan_of(experiment).training.updates
    arms = await experiments.arms_of(session, experiment.id)
    jobs = {
        job.arm: job
        for job in await session.scalars(
            select(models.Job)
            .where(models.Job.experiment_id == experiment.id, models.Job.kind == "train")
            .order_by(models.Job.queued_at, models.Job.id)
        )
    }
    job_ids = [job.id for job in jobs.values()]
    attempts = list(
        await session.scalars(
            select(models.Attempt)
            .where(models.Attempt.job_id.in_(job_ids))
            .order_by(models.Attempt.number, models.Attempt.rank)
        )
    )
    steps = await _steps(session, [attempt.id for attempt in attempts])
    progress = []
    for name in TRAINED_ARMS:
        arm, job = arms[name], jobs.get(name)
        mine = [attempt for attempt in attempts if job is not None and attempt.job_id == job.id]
        losses: dict[int, float] = {}
        for attempt in mine:
            if attempt.rank == 0:
                losses.update((s.step, s.loss) for s in steps[attempt.id].values())
        current = [attempt for attempt in mine if job is not None and attempt.number == job.attempts_made]
        ranks = []
        for attempt in current:
            done = steps[attempt.id]
            ranks.append(
                RankProgress(
                    rank=attempt.rank,
                    attempt=attempt.number,
                    state=attempt.state,
                    done=max(done, default=0),
                    total=updates,
                    updated_at=max((s.at for s in done.values()), default=None),
                    median_seconds=statistics.median(s.seconds for s in done.values()) if done else None,
                )
            )
        progress.append(
            ArmProgress(
                name=name,
                world_size=arm.world_size,
                job=job,
                ranks=ranks,
                final_step=arm.final_step,
                model_identity=arm.model_identity,
                losses=sorted(losses.items()),
            )
        )
    return progress


# Jobs, attempts and their logs ---------------------------------------------------------------------


async def jobs(session: AsyncSession, experiment_id: uuid.UUID) -> list[models.Job]:
    return list(
        await session.scalars(
            select(models.Job)
            .where(models.Job.experiment_id == experiment_id)
            .order_by(models.Job.queued_at, models.Job.id)
        )
    )


async def job(session: AsyncSession, job_id: uuid.UUID, *, lock: bool = False) -> models.Job:
    found = await session.get(models.Job, job_id, with_for_update=lock)
    if found is None:
        raise NotFound(f"job {job_id} does not exist")
    return found


@dataclass(frozen=True)
class AttemptRow:
    attempt: models.Attempt
    agent: str

    @property
    def active(self) -> bool:
        return JobState(self.attempt.state) in JOB_ACTIVE


async def attempts(session: AsyncSession, job_id: uuid.UUID) -> list[AttemptRow]:
    rows = await session.execute(
        select(models.Attempt, models.Agent.name)
        .join(models.Agent, models.Agent.id == models.Attempt.agent_id)
        .where(models.Attempt.job_id == job_id)
        .order_by(models.Attempt.number.desc(), models.Attempt.rank)
    )
    return [AttemptRow(attempt, name) for attempt, name in rows.tuples()]


async def attempt(session: AsyncSession, attempt_id: uuid.UUID) -> models.Attempt:
    found = await session.get(models.Attempt, attempt_id)
    if found is None:
        raise NotFound(f"attempt {attempt_id} does not exist")
    return found


@dataclass(frozen=True)
class LogLine:
    at: datetime.datetime
    kind: str
    text: str


def _line(event: models.Event) -> str:
    if event.kind == "output":
        return str(event.body.get("line", ""))
    if event.kind == "state":
        return f"{event.body.get('from')} -> {event.body.get('to')}: {event.body.get('reason')}"
    return msgspec.json.encode({k: v for k, v in event.body.items() if k != "event"}).decode()


async def log_tail(session: AsyncSession, attempt_id: uuid.UUID, lines: int = LOG_LINES) -> list[LogLine]:
    """The attempt's last events (its command's output and its state changes), oldest first."""
    rows = await session.scalars(
        select(models.Event)
        .where(models.Event.attempt_id == attempt_id)
        .order_by(models.Event.at.desc(), models.Event.id.desc())
        .limit(lines)
    )
    return [LogLine(row.at, row.kind, _line(row)) for row in reversed(list(rows))]


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
        .where(models.Attempt.state.in_([state.value for state in JOB_ACTIVE]))
        .order_by(models.Attempt.created_at)
    )
    running: dict[uuid.UUID, list[tuple[models.Attempt, models.Job]]] = {}
    for attempt_row, job_row in active.tuples():
        running.setdefault(attempt_row.agent_id, []).append((attempt_row, job_row))
    return [AgentRow(row, running.get(row.id, [])) for row in rows]


# Evaluations -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    correct: int = 0
    n: int = 0

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.n if self.n else None

    def __add__(self, other: Cell) -> Cell:
        return Cell(self.correct + other.correct, self.n + other.n)


@dataclass(frozen=True)
class Grid:
    """Accuracy by arm x family x wording (variant), with the totals by family and by arm."""

    arms: list[str]
    families: list[str]
    variants: list[int]
    cells: dict[tuple[str, str, int], Cell]

    def cell(self, arm: str, family: str, variant: int) -> Cell:
        return self.cells.get((arm, family, variant), Cell())

    def family(self, arm: str, family: str) -> Cell:
        return sum((self.cell(arm, family, v) for v in self.variants), Cell())

    def overall(self, arm: str) -> Cell:
        return sum((self.family(arm, f) for f in self.families), Cell())


async def accuracy(session: AsyncSession, experiment_id: uuid.UUID, role: str) -> Grid:
    rows = await session.execute(
        select(
            models.Answer.arm,
            models.Answer.family,
            models.Answer.variant,
            func.count(models.Answer.id),
            func.sum(case((models.Answer.correct, 1), else_=0)),
        )
        .where(models.Answer.experiment_id == experiment_id, models.Answer.role == role)
        .group_by(models.Answer.arm, models.Answer.family, models.Answer.variant)
    )
    cells = {(arm, family, variant): Cell(int(correct), int(n)) for arm, family, variant, n, correct in rows.tuples()}
    arms: list[str] = [arm for arm in EVALUATED_ARMS if any(key[0] == arm for key in cells)]
    families = [family for family in ("lookup", "filter", "total", "sort") if any(key[1] == family for key in cells)]
    return Grid(arms, families, sorted({key[2] for key in cells}), cells)


async def answer(
    session: AsyncSession, experiment_id: uuid.UUID, arm: str, role: str, task_id: str
) -> tuple[models.Answer, wire.AnswerRecord]:
    row = await session.scalar(
        select(models.Answer).where(
            models.Answer.experiment_id == experiment_id,
            models.Answer.arm == arm,
            models.Answer.role == role,
            models.Answer.task_id == task_id,
        )
    )
    if row is None:
        raise NotFound(f"no {role} answer of {arm} to task {task_id} is recorded")
    return row, msgspec.convert(row.body, type=wire.AnswerRecord)


class PreparedTask(msgspec.Struct, frozen=True):
    """The fields of a prepared task line (experiment.corpus.TaskItem) the answer page shows."""

    id: str
    prompt: str
    expected: dict[str, Any]


# The prepared role files in the evidence bundle (experiment.corpus.ROLE_FILES under prepared/); importing
# experiment.corpus would load the model libraries into the coordinator.
ROLE_FILES = {"dev": "prepared/dev.jsonl", "test": "prepared/test.jsonl"}


async def prepared_task(
    session: AsyncSession, settings: Settings, experiment_id: uuid.UUID, role: str, index: int, task_id: str
) -> PreparedTask | None:
    """The task's prompt and expected answer, where the prepare job uploaded its role file; else None."""
    path = ROLE_FILES.get(role)
    listed = next((f for f in await evidence.listing(session, experiment_id) if f.path == path), None)
    if listed is None:
        return None
    _, file = await blobs.find(session, settings, listed.sha256)
    with file.open("rb") as lines:
        line = next((line for number, line in enumerate(lines) if number == index), None)
    if line is None:
        return None
    task = msgspec.json.decode(line, type=PreparedTask)
    return task if task.id == task_id else None
