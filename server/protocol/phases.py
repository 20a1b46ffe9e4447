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

An experiment moves on in one place, ``progress``: a state is entered once the ledger holds the commitment it
stands on (the plan, prepared inputs, selection, test results, serving, report), or, for training, once its jobs
are queued and then all succeeded. Where a phase's own jobs make its commitment (the test evaluations, the
select jobs' verified checkpoints), ``progress`` makes it when the stage that queues them has succeeded.

Autopilot stops where a job failed or was cancelled: a failed job is final and deterministic, so the
operator reads its reason and advances again (which queues the missing jobs) once the cause is fixed.
"""

from __future__ import annotations

import uuid

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
    move_experiment,
    report_follows,
    report_state,
)
from server.protocol import kinds, recording
from server.protocol.kinds import Order
from server.settings import Settings
from server.store import commitments

E = ExperimentState
J = JobState
REPORT = Order(wire.ReportSpec())
# The commitment each state stands on: the experiment enters the state once the ledger holds it.
COMMITTED_BY: dict[ExperimentState, str] = {
    E.COMMITTED: "plan",
    E.PREPARED: "prepared",
    E.SELECTED: "selection",
    E.TESTED: "tested",
    E.SERVING: "serving",
    E.REPORTED: "report",
}
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


def _missing(stage: list[Order], jobs: list[models.Job]) -> list[Order]:
    return [order for order in stage if not any(order.matches(j) and j.state == J.SUCCEEDED for j in jobs)]


def _busy(jobs: list[models.Job]) -> list[models.Job]:
    return [job for job in jobs if job.state in {J.QUEUED, *JOB_ACTIVE}]


def _refuse_while_running(state: ExperimentState, jobs: list[models.Job]) -> None:
    busy = _busy(jobs)
    if busy:
        names = ", ".join(f"{kinds.label(j.kind, j.arm, j.role)} ({j.state})" for j in busy)
        raise Refused("phase-running", f"the {state} phase is still running: {names}")


def _next_stage(plan: Plan, state: ExperimentState, jobs: list[models.Job]) -> list[Order]:
    for stage in stages(plan, state):
        missing = _missing(stage, jobs)
        if missing:
            return missing
    return []


async def create(session: AsyncSession, settings: Settings, body: wire.ExperimentCreate) -> models.Experiment:
    """A new experiment from its plan, committed (and its prepare job queued) unless the body says not yet."""
    experiment = await recording.create(session, body)
    if body.commit:
        await commit(session, settings, experiment)
    return experiment


async def commit(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> None:
    """Commit a draft's plan and queue its first job."""
    await recording.commit_plan(session, experiment)
    await progress(session, settings, experiment)
    await kinds.enqueue(session, settings, experiment, Order(wire.PrepareSpec()))


def _succeeded(orders: list[Order], jobs: list[models.Job]) -> list[models.Job] | None:
    """The job that succeeded for each order, or None while one has not."""
    done = [next((j for j in jobs if order.matches(j) and j.state == J.SUCCEEDED), None) for order in orders]
    found = [job for job in done if job is not None]
    return found if len(found) == len(orders) else None


async def _next_state(
    session: AsyncSession, settings: Settings, experiment: models.Experiment
) -> tuple[ExperimentState, str] | None:
    """The state the experiment enters now, and why; None while its phase is not complete. Where the phase's own
    jobs make the commitment the next state stands on, it is made here, from the stage that queued them."""
    state, plan = experiment.state, recording.plan_of(experiment)
    jobs = await jobs_of(session, experiment.id)
    orders = [order for stage in stages(plan, state) for order in stage]
    if state == E.PREPARED:
        return (E.TRAINING, "training queued") if any(job.kind == "train" for job in jobs) else None
    if state == E.TRAINING:
        done = _succeeded(orders, jobs) is not None
        return (E.TRAINED, "every arm has a verified final checkpoint") if done else None
    ledger = await commitments.by_kind(session, experiment.id)
    if state == E.TRAINED and "selection" not in ledger:
        verified = _succeeded([order for order in orders if order.kind == "select"], jobs)
        if verified is not None:
            await recording.commit_verified(session, settings, experiment, verified)
            return E.SELECTED, ENTERED_BECAUSE[E.SELECTED]
    if state == E.SELECTED and "tested" not in ledger:
        tested = _succeeded([order for order in orders if order.kind == "evaluate" and order.role == "test"], jobs)
        if tested is not None:
            await recording.commit_tested(session, experiment, tested)
            return E.TESTED, ENTERED_BECAUSE[E.TESTED]
    for target in sorted(EXPERIMENT_TRANSITIONS[state]):
        if COMMITTED_BY.get(target) in ledger:
            return target, ENTERED_BECAUSE[target]
    return None


async def progress(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> None:
    """The one place an experiment moves on: while its phase is complete, it enters the next state."""
    while (entered := await _next_state(session, settings, experiment)) is not None:
        move_experiment(session, experiment, *entered)


def halt(session: AsyncSession, experiment: models.Experiment, reason: str) -> None:
    """End the experiment as halted, which is final."""
    move_experiment(session, experiment, E.HALTED, reason)


async def advance(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> str:
    """Queue the next stage's jobs (or commit a draft's plan); refuses while the current stage runs."""
    state = experiment.state
    if state == E.DRAFT:
        await commit(session, settings, experiment)
        return "plan committed; prepare queued"
    plan = recording.plan_of(experiment)
    if state == E.TESTED and plan.serves():
        name = plan.served_arm()
        served = (await recording.arms_of(session, experiment.id))[name]
        body = wire.ServingCreate(arm=name, model_identity=served.model_identity or "")
        await recording.start_serving(session, experiment, body)
        await progress(session, settings, experiment)
        return f"serving committed: the {name} final checkpoint {body.model_identity[:12]}"
    if state in EXPERIMENT_FINAL:
        raise Refused("experiment-final", f"the experiment is {state}; there is nothing to advance")
    jobs = await jobs_of(session, experiment.id)
    _refuse_while_running(state, jobs)
    missing = _next_stage(plan, state, jobs)
    if not missing:
        raise Refused("phase-complete", f"every job of the {state} phase succeeded; nothing is left to queue")
    for order in missing:
        await kinds.enqueue(session, settings, experiment, order)
    await progress(session, settings, experiment)
    return "queued " + ", ".join(str(order) for order in missing)


async def request_report(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> models.Job:
    """Queue the coordinator's own report job: once every serving stage before it succeeded, and again after a
    report job failed. The report is always the coordinator's recomputation from the stored evidence."""
    state = experiment.state
    if state in EXPERIMENT_FINAL:
        raise Refused("experiment-final", f"the experiment is {state}; its report can no longer change")
    plan = recording.plan_of(experiment)
    after = report_follows(plan)
    if state != report_state(plan):
        raise Refused("report-not-ready", f"the report is computed after {after}; the experiment is {state}")
    jobs = await jobs_of(session, experiment.id)
    _refuse_while_running(state, jobs)
    missing = _next_stage(plan, state, jobs)
    if missing != [REPORT]:
        waiting = ", ".join(str(order) for order in missing)
        raise Refused("report-not-ready", f"the report is computed after {after}; it still needs {waiting}")
    return await kinds.enqueue(session, settings, experiment, REPORT)


async def autopilot(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> str | None:
    """Advance if autopilot is on, nothing runs, and no job of the next stage has failed or been cancelled."""
    actions = []
    while experiment.autopilot and experiment.state not in {E.DRAFT, *EXPERIMENT_FINAL}:
        state = experiment.state
        jobs = await jobs_of(session, experiment.id)
        # The serving commitment needs no job: replicas may still start.
        commitment = state == E.TESTED and recording.plan_of(experiment).serves()
        if not commitment and _busy(jobs):
            break
        if not commitment:
            missing = _next_stage(recording.plan_of(experiment), state, jobs)
            if not missing or any(order.matches(job) for order in missing for job in jobs):
                break  # done, or a job of this stage ended without success: the operator decides
        actions.append(await advance(session, settings, experiment))
        if experiment.state == state:
            break  # jobs were queued: the next step waits for them
    return "; ".join(actions) or None


def set_autopilot(experiment: models.Experiment, on: bool) -> None:
    experiment.autopilot = on
