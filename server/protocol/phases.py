"""Phases: the jobs each experiment state waits for, and the one action that queues the next ones.

An operator advances an experiment one phase at a time (REST, ``coop-server experiment advance``, the web
UI); with autopilot on, the coordinator does the same as soon as every job of a phase succeeded. The order:

    committed            prepare
    prepared, training   train each trained arm of the plan (clean-single, damaged-single, clean-pair)
    trained              dev evaluations of every arm, then a select job per trained arm on the host
                         holding its checkpoint (their success commits the selection: state selected)
    selected             the test evaluations of every arm, and a replica of the served arm's selected
                         checkpoint on each host of the pair (it needs the selection only)
    tested               the serving commitment: the served arm's selected final checkpoint (no job); a plan
                         that serves no arm (the local-SGD design) has its report instead
    serving              a replica on each host of the pair where none was started, the single, pair and
                         failure benchmarks (the failure phase stops rank 1's replica midway: replicas.py),
                         both replicas stopped, then the report, run by the coordinator itself on the stored
                         evidence

An experiment moves on in one place, ``progress``. Each step is decided from the experiment's standing (state,
plan, jobs and ledger, read at once) by two pure functions, then taken:
- ``entered``: a state is entered once the ledger holds the commitment it stands on (the plan, prepared inputs,
  selection, test results, serving, report), or, for training, once its jobs are queued and then all succeeded.
  Where a phase's own jobs make its commitment (the select jobs' verified checkpoints, the test evaluations), the
  step makes it once the stage that queued them has succeeded.
- ``driven``: what advancing does (the operator's ``advance``, and autopilot): the serving commitment once tested,
  or the next stage's missing jobs.

Autopilot stops where a job failed or was cancelled: a failed job is final and deterministic, so the
operator reads its reason and advances again (which queues the missing jobs) once the cause is fixed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.plan import Plan
from experiment.core.states import ExperimentState, JobState
from experiment.serving.servingrecord import PHASES
from server import models
from server.dispatch.lifecycle import (
    EXPERIMENT_FINAL,
    EXPERIMENT_TRANSITIONS,
    JOB_ACTIVE,
    Refused,
    experiment_target,
    move_experiment,
)
from server.protocol import canaries, kinds, recording
from server.protocol.guards import report_follows, report_state
from server.protocol.kinds import Order
from server.settings import Settings
from server.store import commitments, views
from server.store.commitments import Ledger

E = ExperimentState
J = JobState
REPORT = Order(wire.ReportSpec())
# The commitment each state stands on: the experiment enters the state once the ledger holds it.
COMMITTED_BY: dict[ExperimentState, str] = {state: kind for kind, state in recording.ENTERS.items()}
ENTERED_BECAUSE: dict[ExperimentState, str] = {
    E.COMMITTED: "plan committed",
    E.PREPARED: "prepared inputs committed",
    E.SELECTED: "final checkpoints selected",
    E.TESTED: "every arm was evaluated on the test role",
    E.SERVING: "serving committed",
    E.REPORTED: "report recorded",
}


def stages(plan: Plan, state: ExperimentState) -> list[list[Order]]:
    """The state's phase as stages in order: a stage is queued once the one before it has succeeded."""
    trained, evaluated = plan.trained_arms(), plan.arm_names()
    training = [[Order(wire.TrainSpec(), arm) for arm in trained]]
    tests = [Order(wire.EvaluateSpec(), arm, "test") for arm in evaluated]
    table: dict[ExperimentState, list[list[Order]]] = {
        E.COMMITTED: [[Order(wire.PrepareSpec())]],
        E.PREPARED: training,
        E.TRAINING: training,
        E.TRAINED: [
            [Order(wire.EvaluateSpec(), arm, "dev") for arm in evaluated],
            [Order(wire.SelectSpec(), arm) for arm in trained],
        ],
        E.SELECTED: [tests],
    }
    if not plan.serves():  # the local-SGD design: reported once tested
        return (table | {E.TESTED: [[REPORT]]}).get(state, [])
    served = plan.served_arm()
    ranks = range(plan.world_size(served))
    replicas = [Order(wire.ReplicaStartSpec(rank=rank), served) for rank in ranks]
    serving = {
        # The replicas start beside the test evaluations (queued after them, so a host evaluates first).
        E.SELECTED: [[*tests, *replicas]],
        E.SERVING: [
            replicas,
            *([Order(wire.BenchmarkSpec(phase=phase), served)] for phase in PHASES),
            [Order(wire.ReplicaStopSpec(rank=rank), served) for rank in ranks],
            [REPORT],
        ],
    }
    return (table | serving).get(state, [])


async def jobs_of(session: AsyncSession, experiment_id: uuid.UUID) -> list[models.Job]:
    rows = await session.scalars(
        select(models.Job).where(models.Job.experiment_id == experiment_id).order_by(models.Job.queued_at)
    )
    return list(rows)


@dataclass(frozen=True)
class Standing:
    """What the experiment stands on now, read at once: its state, plan, jobs and ledger."""

    state: ExperimentState
    plan: Plan
    jobs: list[models.Job]
    ledger: Ledger

    def busy(self) -> list[models.Job]:
        return [job for job in self.jobs if job.state in {J.QUEUED, *JOB_ACTIVE}]

    def succeeded(self, orders: list[Order]) -> list[models.Job] | None:
        """The job that succeeded for each order, or None while one has not."""
        done = [next((j for j in self.jobs if o.matches(j) and j.state == J.SUCCEEDED), None) for o in orders]
        found = [job for job in done if job is not None]
        return found if len(found) == len(orders) else None

    def next_stage(self) -> list[Order]:
        """The first stage of the phase that is not done: those of its orders that have no succeeded job."""
        for stage in stages(self.plan, self.state):
            missing = [order for order in stage if self.succeeded([order]) is None]
            if missing:
                return missing
        return []


async def standing_of(session: AsyncSession, experiment: models.Experiment) -> Standing:
    jobs = await jobs_of(session, experiment.id)
    ledger = await commitments.committed(session, experiment.id)
    return Standing(experiment.state, views.plan_of(experiment), jobs, ledger)


# The steps that move an experiment, each decided from its standing alone.
@dataclass(frozen=True)
class Enter:
    state: ExperimentState
    reason: str


@dataclass(frozen=True)
class Commit:
    """The commitment the next state stands on: made from the jobs of the stage that queued them (selection:
    the select jobs' verified checkpoints; tested: the test evaluations), or with no job (serving)."""

    kind: str
    jobs: list[models.Job]


@dataclass(frozen=True)
class Queue:
    orders: list[Order]


@dataclass(frozen=True)
class Wait:
    """No step to take now, and why (an operator's advance is refused with it)."""

    rule: str
    detail: str


Step = Enter | Commit | Queue
# The commitments a stage's own jobs make: (the commitment, the kind and role of the jobs it is made from).
MADE_BY_JOBS: dict[ExperimentState, tuple[str, wire.JobKind, str | None]] = {
    E.TRAINED: ("selection", "select", None),
    E.SELECTED: ("tested", "evaluate", "test"),
}


def entered(standing: Standing) -> Step | None:
    """The state the experiment enters now, or the commitment it makes to enter it; None while its phase is not
    complete."""
    state, jobs = standing.state, standing.jobs
    orders = [order for stage in stages(standing.plan, state) for order in stage]
    if state == E.PREPARED:
        return Enter(E.TRAINING, "training queued") if any(job.kind == "train" for job in jobs) else None
    if state == E.TRAINING:
        done = standing.succeeded(orders) is not None
        return Enter(E.TRAINED, "every arm has a verified final checkpoint") if done else None
    if state in MADE_BY_JOBS and not standing.ledger.has(MADE_BY_JOBS[state][0]):
        commitment, kind, role = MADE_BY_JOBS[state]
        made = standing.succeeded([order for order in orders if order.kind == kind and order.role == role])
        return None if made is None else Commit(commitment, made)
    for target in sorted(EXPERIMENT_TRANSITIONS[state]):
        if target in COMMITTED_BY and standing.ledger.has(COMMITTED_BY[target]):
            return Enter(target, ENTERED_BECAUSE[target])
    return None


def driven(standing: Standing, *, retry: bool) -> Step | Wait:
    """What advancing does now: the serving commitment once tested, else the next stage's missing jobs. Only the
    operator retries (``retry``): autopilot waits where a job of the stage ended without success."""
    state = standing.state
    if state in {E.DRAFT, *EXPERIMENT_FINAL}:
        return Wait("experiment-final", f"the experiment is {state}; there is nothing to advance")
    if state == E.TESTED and standing.plan.serves():  # replicas may still start
        return Commit("serving", [])
    busy = standing.busy()
    if busy:
        names = ", ".join(f"{kinds.label(j.kind, j.arm, j.role)} ({j.state})" for j in busy)
        return Wait("phase-running", f"the {state} phase is still running: {names}")
    missing = standing.next_stage()
    if not missing:
        return Wait("phase-complete", f"every job of the {state} phase succeeded; nothing is left to queue")
    if not retry and any(order.matches(job) for order in missing for job in standing.jobs):
        return Wait("job-ended", f"a job of the {state} phase ended without success; the operator decides")
    return Queue(missing)


async def _take(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, standing: Standing, step: Step
) -> str:
    """Take one step from where the experiment stands; what was done, in words."""
    plan = standing.plan
    if isinstance(step, Enter):
        move_experiment(session, experiment, step.state, step.reason)
        return f"{step.state}: {step.reason}"
    if isinstance(step, Queue):
        for order in step.orders:
            await kinds.enqueue(session, settings, experiment, order, plan, standing.ledger)
        return "queued " + ", ".join(str(order) for order in step.orders)
    if step.kind == "selection":
        document = await recording.verified_selection(session, experiment, plan, step.jobs)
    elif step.kind == "tested":
        document = await recording.tested(session, plan, step.jobs)
    else:
        document = await recording.final_serving(session, experiment, plan)
    await recording.commit(session, settings, experiment, document)
    if document.kind != "serving":
        return f"{document.kind} committed"
    served = document.body
    return f"serving committed: the {served['arm']} final checkpoint {str(served['model_identity'])[:12]}"


async def _enter(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> Standing:
    """Enter each state whose phase is complete; the standing reached."""
    while (step := entered(standing := await standing_of(session, experiment))) is not None:
        await _take(session, settings, experiment, standing, step)
    return standing


async def progress(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> str | None:
    """The one place an experiment moves on: it enters each state whose phase is complete and, with autopilot on,
    advances as the operator would until a stage runs or a job of it ended without success. What autopilot did,
    in words (None where it did nothing)."""
    done = []
    standing = await _enter(session, settings, experiment)
    while experiment.autopilot and not isinstance(step := driven(standing, retry=False), Wait):
        done.append(await _take(session, settings, experiment, standing, step))
        standing = await _enter(session, settings, experiment)
    return "; ".join(done) or None


async def create(session: AsyncSession, settings: Settings, body: wire.ExperimentCreate) -> models.Experiment:
    """A new experiment from its plan, committed (and its prepare job queued) unless the body says not yet."""
    experiment = await recording.create(session, body)
    if body.commit:
        await commit(session, settings, experiment, body.canary_override)
    return experiment


async def commit(
    session: AsyncSession, settings: Settings, experiment: models.Experiment, canary_override: str | None = None
) -> None:
    """Commit a draft's plan, past the canary gate (protocol.canaries), and queue its first job."""
    experiment_target(experiment.state, E.COMMITTED)
    canary = await canaries.gate(session, experiment, views.plan_of(experiment), canary_override)
    await recording.commit_plan(session, settings, experiment, canary)
    standing = await _enter(session, settings, experiment)
    await _take(session, settings, experiment, standing, Queue([Order(wire.PrepareSpec())]))


def halt(session: AsyncSession, experiment: models.Experiment, reason: str) -> None:
    """End the experiment as halted, which is final."""
    move_experiment(session, experiment, E.HALTED, reason)


async def advance(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> str:
    """Take the next step (commit a draft's plan, queue the next stage's jobs, or make the serving commitment);
    refuses while the current stage runs."""
    if experiment.state == E.DRAFT:
        await commit(session, settings, experiment)
        return "plan committed; prepare queued"
    standing = await standing_of(session, experiment)
    step = driven(standing, retry=True)
    if isinstance(step, Wait):
        raise Refused(step.rule, step.detail)
    done = await _take(session, settings, experiment, standing, step)
    await progress(session, settings, experiment)
    return done


async def request_report(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> models.Job:
    """Queue the coordinator's own report job: once every serving stage before it succeeded, and again after a
    report job failed. The report is always the coordinator's recomputation from the stored evidence."""
    state = experiment.state
    if state in EXPERIMENT_FINAL:
        raise Refused("experiment-final", f"the experiment is {state}; its report can no longer change")
    standing = await standing_of(session, experiment)
    after = report_follows(standing.plan)
    if state != report_state(standing.plan):
        raise Refused("report-not-ready", f"the report is computed after {after}; the experiment is {state}")
    step = driven(standing, retry=True)
    if isinstance(step, Wait) and step.rule == "phase-running":
        raise Refused(step.rule, step.detail)
    missing = standing.next_stage()
    if missing != [REPORT]:
        waiting = ", ".join(str(order) for order in missing)
        raise Refused("report-not-ready", f"the report is computed after {after}; it still needs {waiting}")
    return await kinds.enqueue(session, settings, experiment, REPORT, standing.plan, standing.ledger)


async def queue(session: AsyncSession, settings: Settings, experiment: models.Experiment, order: Order) -> models.Job:
    """Queue one job the protocol allows where the experiment stands now (an operator's job, a replica stop)."""
    standing = await standing_of(session, experiment)
    return await kinds.enqueue(session, settings, experiment, order, standing.plan, standing.ledger)


def set_autopilot(experiment: models.Experiment, on: bool) -> None:
    experiment.autopilot = on
