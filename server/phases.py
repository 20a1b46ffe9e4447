"""Phases: the jobs each experiment state waits for, and the one action that queues the next ones.

An operator advances an experiment one phase at a time (REST, ``coop-server experiment advance``, the web
UI); with autopilot on, the coordinator does the same as soon as every job of a phase succeeded. The order:

    committed            prepare
    prepared, training   train clean-single, damaged-single, clean-pair
    trained              dev evaluations of the four arms, then a select job per trained arm on the host
                         holding its checkpoint (their success commits the selection: state selected)
    selected             the four test evaluations
    tested               the serving commitment: the selected clean-pair final checkpoint (no job)
    serving              a replica on each host of the pair, the single, pair and failure benchmarks (the
                         failure phase stops rank 1's replica midway: serving.py), both replicas stopped,
                         then the report, run by the coordinator itself on the stored evidence

Autopilot stops where a job failed or was cancelled: a failed job is final and deterministic, so the
operator reads its reason and advances again (which queues the missing jobs) once the cause is fixed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import experiments, models, serving
from server.lifecycle import (
    EVALUATED_ARMS,
    EXPERIMENT_FINAL,
    JOB_ACTIVE,
    SERVED_ARM,
    TRAINED_ARMS,
    ExperimentState,
    JobState,
    Refused,
)
from server.settings import Settings

E = ExperimentState
J = JobState


@dataclass(frozen=True)
class Want:
    """A job a phase needs to have succeeded."""

    kind: wire.JobKind
    arm: wire.ArmName | None = None
    role: wire.Role | None = None
    # Serving jobs differ by spec: the replica's rank, the benchmark's phase.
    spec: tuple[tuple[str, str | int], ...] = ()

    def matches(self, job: models.Job) -> bool:
        return (job.kind, job.arm, job.role) == (self.kind, self.arm, self.role) and all(
            job.spec.get(key) == value for key, value in self.spec
        )

    def __str__(self) -> str:
        labels = [part for part in (self.kind, self.role, self.arm) if part]
        return " ".join([*labels, *(f"{key} {value}" for key, value in self.spec)])


_TRAINING = [[Want("train", arm) for arm in TRAINED_ARMS]]
# Per state, the phase's stages in order: a stage is queued once the one before it has succeeded.
STAGES: dict[ExperimentState, list[list[Want]]] = {
    E.COMMITTED: [[Want("prepare")]],
    E.PREPARED: _TRAINING,
    E.TRAINING: _TRAINING,
    E.TRAINED: [
        [Want("evaluate", arm, "dev") for arm in EVALUATED_ARMS],
        [Want("select", arm) for arm in TRAINED_ARMS],
    ],
    E.SELECTED: [[Want("evaluate", arm, "test") for arm in EVALUATED_ARMS]],
    E.SERVING: [
        [
            Want("replica-start", SERVED_ARM, spec=(("rank", 0),)),
            Want("replica-start", SERVED_ARM, spec=(("rank", 1),)),
        ],
        *([Want("benchmark", SERVED_ARM, spec=(("phase", phase),))] for phase in ("single", "pair", "failure")),
        [Want("replica-stop", SERVED_ARM, spec=(("rank", 0),)), Want("replica-stop", SERVED_ARM, spec=(("rank", 1),))],
        [Want("report")],
    ],
}


async def jobs_of(session: AsyncSession, experiment_id: uuid.UUID) -> list[models.Job]:
    rows = await session.scalars(
        select(models.Job).where(models.Job.experiment_id == experiment_id).order_by(models.Job.queued_at)
    )
    return list(rows)


def _missing(stage: list[Want], jobs: list[models.Job]) -> list[Want]:
    return [want for want in stage if not any(want.matches(j) and j.state == J.SUCCEEDED for j in jobs)]


def _busy(jobs: list[models.Job]) -> list[models.Job]:
    return [job for job in jobs if J(job.state) in {J.QUEUED, *JOB_ACTIVE}]


def _refuse_while_running(state: ExperimentState, jobs: list[models.Job]) -> None:
    busy = _busy(jobs)
    if busy:
        names = ", ".join(f"{Want(j.kind, j.arm, j.role)} ({j.state})" for j in busy)  # type: ignore[arg-type]
        raise Refused("phase-running", f"the {state} phase is still running: {names}")


def _next_stage(state: ExperimentState, jobs: list[models.Job]) -> list[Want]:
    for stage in STAGES.get(state, []):
        missing = _missing(stage, jobs)
        if missing:
            return missing
    return []


async def advance(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> str:
    """Queue the next stage's jobs (or commit a draft's plan); refuses while the current stage runs."""
    state = E(experiment.state)
    if state == E.DRAFT:
        await experiments.commit_plan(session, settings, experiment)
        return "plan committed; prepare queued"
    if state == E.TESTED:
        served = (await experiments.arms_of(session, experiment.id))[SERVED_ARM]
        body = wire.ServingCreate(arm=SERVED_ARM, model_identity=served.model_identity or "")
        await experiments.start_serving(session, experiment, body)
        return f"serving committed: the {SERVED_ARM} final checkpoint {body.model_identity[:12]}"
    if state in EXPERIMENT_FINAL:
        raise Refused("experiment-final", f"the experiment is {state}; there is nothing to advance")
    jobs = await jobs_of(session, experiment.id)
    _refuse_while_running(state, jobs)
    missing = _next_stage(state, jobs)
    if not missing:
        raise Refused("phase-complete", f"every job of the {state} phase succeeded; nothing is left to queue")
    for want in missing:
        if want.kind in serving.KINDS:
            await serving.enqueue(session, settings, experiment, want.kind, dict(want.spec))
        else:
            await experiments.enqueue(session, settings, experiment, wire.JobCreate(want.kind, want.arm, want.role))
    return "queued " + ", ".join(str(want) for want in missing)


async def request_report(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> models.Job:
    """Queue the coordinator's own report job: once every serving stage before it succeeded, and again after a
    report job failed. The report is always the coordinator's recomputation from the stored evidence."""
    state = E(experiment.state)
    if state in EXPERIMENT_FINAL:
        raise Refused("experiment-final", f"the experiment is {state}; its report can no longer change")
    if state != E.SERVING:
        raise Refused("report-not-ready", f"the report is computed after the serving phase; the experiment is {state}")
    jobs = await jobs_of(session, experiment.id)
    _refuse_while_running(state, jobs)
    missing = _next_stage(state, jobs)
    if missing != [Want("report")]:
        waiting = ", ".join(str(want) for want in missing)
        raise Refused("report-not-ready", f"the report is computed after the serving phase; it still needs {waiting}")
    return await experiments.enqueue(session, settings, experiment, wire.JobCreate("report"))


async def autopilot(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> str | None:
    """Advance if autopilot is on, nothing runs, and no job of the next stage has failed or been cancelled."""
    actions = []
    while experiment.autopilot and E(experiment.state) not in {E.DRAFT, *EXPERIMENT_FINAL}:
        state = E(experiment.state)
        jobs = await jobs_of(session, experiment.id)
        if _busy(jobs):
            break
        if state != E.TESTED:
            missing = _next_stage(state, jobs)
            if not missing or any(want.matches(job) for want in missing for job in jobs):
                break  # done, or a job of this stage ended without success: the operator decides
        actions.append(await advance(session, settings, experiment))
        if E(experiment.state) == state:
            break  # jobs were queued: the next step waits for them
    return "; ".join(actions) or None


def set_autopilot(experiment: models.Experiment, on: bool) -> None:
    experiment.autopilot = on
