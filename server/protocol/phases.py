"""Phases: an experiment moved along the protocol's table (``table.TABLE``: each state, what enters it, the
jobs it queues, the commitment it makes), and nothing else deciding its next step.

An operator advances an experiment one phase at a time (REST, ``coop-server experiment advance``, the web
UI); with autopilot on, the coordinator does the same as soon as every job of a phase succeeded.

An experiment moves on in one place, ``progress``. Each step is decided from the experiment's standing (state,
plan, jobs and ledger, read at once) by two pure functions, then taken:
- ``entered``: the next state whose row's entry holds (its commitment in the ledger, its jobs queued, or the state
  before's jobs all succeeded); where the state's own jobs make its commitment (the select jobs' verified
  checkpoints, the test evaluations), the step makes it once the stage that queued them has succeeded.
- ``driven``: what advancing does (the operator's ``advance``, and autopilot): the commitment the state makes with
  no job (serving, once tested), or the next stage's missing jobs.

Autopilot stops where a job failed or was cancelled: a failed job is final and deterministic, so the
operator reads its reason and advances again (which queues the missing jobs) once the cause is fixed.
"""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.states import ExperimentState, JobState
from server import models
from server.dispatch.lifecycle import (
    EXPERIMENT_FINAL,
    Refused,
    experiment_target,
    move_experiment,
)
from server.protocol import canaries, kinds, recording
from server.protocol.guards import report_follows, report_state
from server.protocol.table import REPORT, Enter, Order, Queue, Standing, Step, Wait, driven, entered
from server.settings import Settings
from server.store import commitments, views

E = ExperimentState
J = JobState


async def jobs_of(session: AsyncSession, experiment_id: uuid.UUID) -> list[models.Job]:
    rows = await session.scalars(
        select(models.Job).where(models.Job.experiment_id == experiment_id).order_by(models.Job.queued_at)
    )
    return list(rows)


async def standing_of(session: AsyncSession, experiment: models.Experiment) -> Standing:
    jobs = await jobs_of(session, experiment.id)
    ledger = await commitments.committed(session, experiment.id)
    return Standing(experiment.state, views.plan_of(experiment), jobs, ledger)


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
    document = await recording.MAKERS[step.kind](session, experiment, plan, step.jobs)
    await recording.commit(session, settings, experiment, document)
    if document.kind != "serving":
        return f"{document.kind} committed"
    served = document.body
    return f"serving committed: the {served['arm']} final checkpoint {str(served['model_identity'])[:12]}"


async def _enter(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> Standing:
    """Enter each state whose phase is complete; the standing reached."""
    while True:
        standing = await standing_of(session, experiment)
        step = entered(standing)
        if step is None:
            return standing
        await _take(session, settings, experiment, standing, step)


async def progress(session: AsyncSession, settings: Settings, experiment: models.Experiment) -> str | None:
    """The one place an experiment moves on: it enters each state whose phase is complete and, with autopilot on,
    advances as the operator would until a stage runs or a job of it ended without success. What autopilot did,
    in words (None where it did nothing)."""
    done: list[str] = []
    while True:
        standing = await standing_of(session, experiment)
        step = entered(standing)
        driving = step is None and experiment.autopilot
        if driving:
            wanted = driven(standing, retry=False)
            step = None if isinstance(wanted, Wait) else wanted
        if step is None:
            return "; ".join(done) or None
        taken = await _take(session, settings, experiment, standing, step)
        if driving:
            done.append(taken)


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
