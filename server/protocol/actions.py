"""The operator's actions, one function each: the REST API and the web UI both call these, so an action does the
same thing, and leaves the same audit row, whichever way it was asked for. Each takes the experiment or job its
caller loaded under lock (the web UI shows it in a confirmation first) and the principal who asked."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.access import audit
from server.access.tokens import Principal
from server.dispatch.lifecycle import Refused
from server.protocol import kinds, phases, reactions, recording
from server.settings import Settings
from server.store import views


def _target(experiment: models.Experiment) -> str:
    return f"experiment:{experiment.id}"


async def create(
    session: AsyncSession, settings: Settings, who: Principal, body: wire.ExperimentCreate
) -> models.Experiment:
    experiment = await phases.create(session, settings, body)
    override = {"canary_override": body.canary_override} if body.commit and body.canary_override else {}
    await audit.record(session, who, "experiment.create", _target(experiment), commit=body.commit, **override)
    return experiment


async def commit(
    session: AsyncSession, settings: Settings, who: Principal, experiment: models.Experiment, body: wire.PlanCommit
) -> None:
    await phases.commit(session, settings, experiment, body.canary_override)
    override = {"canary_override": body.canary_override} if body.canary_override else {}
    await audit.record(session, who, "experiment.commit", _target(experiment), **override)


async def advance(session: AsyncSession, settings: Settings, who: Principal, experiment: models.Experiment) -> str:
    """Queue the next phase's jobs, or make the commitment the phase waits for; what was done, in words."""
    action = await phases.advance(session, settings, experiment)
    await audit.record(session, who, "experiment.advance", _target(experiment), queued=action)
    return action


async def set_autopilot(
    session: AsyncSession, settings: Settings, who: Principal, experiment: models.Experiment, on: bool
) -> str | None:
    """Switch autopilot; switched on, it advances at once if the current phase is done (what it did, if anything)."""
    phases.set_autopilot(experiment, on)
    await audit.record(session, who, "experiment.autopilot", _target(experiment), on=on)
    return await phases.progress(session, settings, experiment)


async def select(
    session: AsyncSession, settings: Settings, who: Principal, experiment: models.Experiment, body: wire.SelectionCreate
) -> None:
    await recording.select_checkpoints(session, settings, experiment, body)
    await audit.record(session, who, "experiment.select", _target(experiment))
    await phases.progress(session, settings, experiment)


async def serve(
    session: AsyncSession, settings: Settings, who: Principal, experiment: models.Experiment, body: wire.ServingCreate
) -> None:
    document = await recording.serving(session, experiment, views.plan_of(experiment), body)
    await recording.commit(session, settings, experiment, document)
    await audit.record(session, who, "experiment.serve", _target(experiment), arm=body.arm)
    await phases.progress(session, settings, experiment)


async def request_report(
    session: AsyncSession, settings: Settings, who: Principal, experiment: models.Experiment
) -> models.Job:
    job = await phases.request_report(session, settings, experiment)
    await audit.record(session, who, "experiment.report", _target(experiment), job=str(job.id))
    return job


async def halt(session: AsyncSession, who: Principal, experiment: models.Experiment) -> None:
    """End the experiment as halted, which is final."""
    phases.halt(session, experiment, f"halted by {who.name}")
    await audit.record(session, who, "experiment.halt", _target(experiment))


async def queue_job(
    session: AsyncSession, settings: Settings, who: Principal, experiment: models.Experiment, body: wire.JobCreate
) -> models.Job:
    job = await phases.queue(session, settings, experiment, kinds.order_of(body))
    await audit.record(session, who, "job.queue", f"job:{job.id}", kind=body.kind, arm=body.arm, role=body.role)
    await phases.progress(session, settings, experiment)
    return job


async def stop_replica(
    session: AsyncSession, settings: Settings, who: Principal, experiment: models.Experiment, rank: int
) -> models.Job:
    """Queue a replica-stop job on the host of the served arm's rank ``rank``."""
    plan = views.plan_of(experiment)
    if not plan.serves():
        raise Refused("serving-not-planned", f"plan {plan.name} serves no arm")
    order = kinds.order_of(wire.JobCreate(kind="replica-stop", arm=plan.served_arm(), spec={"rank": rank}))
    job = await phases.queue(session, settings, experiment, order)
    await audit.record(session, who, "replica.stop", f"job:{job.id}", rank=rank)
    return job


async def cancel(session: AsyncSession, settings: Settings, who: Principal, job: models.Job, grace: float) -> None:
    """Cancel a job: a queued one at once, a running one asked to stop and forced after ``grace`` seconds."""
    await reactions.cancel(session, settings, job, grace)
    await audit.record(session, who, "job.cancel", f"job:{job.id}", grace_seconds=grace)
