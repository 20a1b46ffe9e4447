"""Training progress for the arms page: per rank, the updates done (live ``step`` events, completed by the
step journal of the result), when the last one came, how long updates take and what the rank wrote per update
(its collectives' bytes); how each arm's ranks synchronize, a DiLoCo arm's outer steps; rank 0's loss per update."""

from __future__ import annotations

import datetime
import statistics
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.canonical import Json, JsonObject
from experiment.core.plan import ArmPlan
from server import models
from server.protocol import recording
from server.store import runs, views


@dataclass(frozen=True)
class Step:
    step: int
    loss: float
    seconds: float
    at: datetime.datetime
    written_bytes: int | None


@dataclass(frozen=True)
class RankProgress:
    rank: int
    attempt: int
    state: str
    done: int
    total: int
    updated_at: datetime.datetime | None
    median_seconds: float | None
    written_per_update: float | None  # the mean over its updates so far

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
    synchronization: str  # how the ranks meet: one rank, every update (DDP), or DiLoCo's outer step
    sync_every: int | None  # DiLoCo's H; None for an arm that synchronizes every update
    outer_steps: int | None  # DiLoCo's outer steps so far (rank 0's updates // H)


def _scalar(value: Json) -> str | int | float:
    """A number (or a number's text) of an event's body; TypeError for null, a list or an object."""
    if value is None or isinstance(value, list | dict):
        raise TypeError(f"{value!r} is not a number")
    return value


def _step(body: JsonObject, at: datetime.datetime, key: str) -> Step | None:
    try:
        written = body.get("written_bytes")
        return Step(
            int(_scalar(body[key])),
            float(_scalar(body["loss"])),
            float(_scalar(body["seconds"])),
            at,
            None if written is None else int(_scalar(written)),
        )
    except (KeyError, TypeError, ValueError):
        return None  # an event from another command version: progress shows what it can


async def _steps(session: AsyncSession, attempt_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, dict[int, Step]]:
    """Per attempt, its updates: the live ``step`` events, completed by the step journal of its result."""
    found: dict[uuid.UUID, dict[int, Step]] = {attempt_id: {} for attempt_id in attempt_ids}
    for attempt_id, at, body in await runs.step_rows(session, models.Event, attempt_ids):
        step = _step(body, at, "done")
        if attempt_id is not None and step is not None:
            found[attempt_id][step.step] = step
    for attempt_id, at, body in await runs.step_rows(session, models.Measurement, attempt_ids):
        step = _step(body, at, "step")
        if attempt_id is not None and step is not None:
            found[attempt_id].setdefault(step.step, step)
    return found


async def training(session: AsyncSession, experiment: models.Experiment) -> list[ArmProgress]:
    plan = views.plan_of(experiment)
    updates = plan.training.updates
    arms = await recording.arms_of(session, experiment.id)
    jobs = await runs.train_jobs(session, experiment.id)
    attempts = await runs.attempts_of(session, [job.id for job in jobs.values()])
    steps = await _steps(session, [attempt.id for attempt in attempts])
    progress = []
    for name in plan.trained_arms():
        arm, job = arms[name], jobs.get(name)
        mine = [attempt for attempt in attempts if job is not None and attempt.job_id == job.id]
        losses = _rank0_losses(mine, steps)
        current = [attempt for attempt in mine if job is not None and attempt.number == job.attempts_made]
        ranks = [_rank_progress(attempt, steps[attempt.id], updates) for attempt in current]
        described = plan.arm_plan(name)
        every = described.sync_every if described.diloco else None
        progress.append(
            ArmProgress(
                name=name,
                world_size=arm.world_size,
                job=job,
                ranks=ranks,
                final_step=arm.final_step,
                model_identity=arm.model_identity,
                losses=sorted(losses.items()),
                synchronization=_synchronization(arm.world_size, every, described),
                sync_every=every,
                outer_steps=None if every is None else max(losses, default=0) // every,
            )
        )
    return progress


def _rank0_losses(attempts: Sequence[models.Attempt], steps: dict[uuid.UUID, dict[int, Step]]) -> dict[int, float]:
    """Rank 0's loss per update, a later generation's steps replacing an earlier one's."""
    losses: dict[int, float] = {}
    for attempt in attempts:
        if attempt.rank == 0:
            losses.update((s.step, s.loss) for s in steps[attempt.id].values())
    return losses


def _rank_progress(attempt: models.Attempt, done: dict[int, Step], updates: int) -> RankProgress:
    written = [s.written_bytes for s in done.values() if s.written_bytes is not None]
    return RankProgress(
        rank=attempt.rank,
        attempt=attempt.number,
        state=attempt.state,
        done=max(done, default=0),
        total=updates,
        updated_at=max((s.at for s in done.values()), default=None),
        median_seconds=statistics.median(s.seconds for s in done.values()) if done else None,
        written_per_update=statistics.fmean(written) if written else None,
    )


def _synchronization(world_size: int, every: int | None, arm: ArmPlan) -> str:
    if every is not None:
        return (
            f"DiLoCo: an outer Nesterov step every {every} updates "
            f"(rate {arm.outer_learning_rate:g}, momentum {arm.outer_momentum:g})"
        )
    return "one rank" if world_size == 1 else f"DDP: a gradient all-reduce over {world_size} ranks every update"
