"""The operator's actions, one function each: the REST API and the web UI both call these, so an action does the
same thing, and leaves the same audit row, whichever way it was asked for. Each takes the ``Operator`` (who asked, in
which database session) and the experiment or job the operator loaded under lock (the web UI shows it in a
confirmation first)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.access import audit
from server.access.tokens import Principal
from server.dispatch.lifecycle import Refused
from server.protocol import kinds, phases, reactions, recording
from server.settings import Settings
from server.store import views


@dataclass(frozen=True)
class Operator:
    """Who acts (the principal of the API's bearer token or of the web UI's session), in the request's database
    session, under the coordinator's settings."""

    session: AsyncSession
    settings: Settings
    who: Principal

    async def experiment(self, experiment_id: uuid.UUID) -> models.Experiment:
        """The experiment to act on, locked for the action."""
        return await recording.load(self.session, experiment_id, lock=True)

    async def job(self, job_id: uuid.UUID) -> models.Job:
        """The job to act on, locked for the action."""
        return await views.found(self.session, models.Job, job_id, lock=True)


def _target(experiment: models.Experiment) -> str:
    return f"experiment:{experiment.id}"


async def create(op: Operator, body: wire.ExperimentCreate) -> models.Experiment:
    experiment = await phases.create(op.session, op.settings, body)
    override = {"canary_override": body.canary_override} if body.commit and body.canary_override else {}
    await audit.record(op.session, op.who, "experiment.create", _target(experiment), commit=body.commit, **override)
    return experiment


async def commit(op: Operator, experiment: models.Experiment, body: wire.PlanCommit) -> None:
    await phases.commit(op.session, op.settings, experiment, body.canary_override)
    override = {"canary_override": body.canary_override} if body.canary_override else {}
    await audit.record(op.session, op.who, "experiment.commit", _target(experiment), **override)


async def advance(op: Operator, experiment: models.Experiment) -> str:
    """Queue the next phase's jobs, or make the commitment the phase waits for; what was done, in words."""
    action = await phases.advance(op.session, op.settings, experiment)
    await audit.record(op.session, op.who, "experiment.advance", _target(experiment), queued=action)
    return action


async def set_autopilot(op: Operator, experiment: models.Experiment, on: bool) -> str | None:
    """Switch autopilot; switched on, it advances at once if the current phase is done (what it did, if anything)."""
    phases.set_autopilot(experiment, on)
    await audit.record(op.session, op.who, "experiment.autopilot", _target(experiment), on=on)
    return await phases.progress(op.session, op.settings, experiment)


async def select(op: Operator, experiment: models.Experiment, body: wire.SelectionCreate) -> None:
    await recording.select_checkpoints(op.session, op.settings, experiment, body)
    await audit.record(op.session, op.who, "experiment.select", _target(experiment))
    await phases.progress(op.session, op.settings, experiment)


async def serve(op: Operator, experiment: models.Experiment, body: wire.ServingCreate) -> None:
    document = await recording.serving(op.session, experiment, views.plan_of(experiment), body)
    await recording.commit(op.session, op.settings, experiment, document)
    await audit.record(op.session, op.who, "experiment.serve", _target(experiment), arm=body.arm)
    await phases.progress(op.session, op.settings, experiment)


async def request_report(op: Operator, experiment: models.Experiment) -> models.Job:
    job = await phases.request_report(op.session, op.settings, experiment)
    await audit.record(op.session, op.who, "experiment.report", _target(experiment), job=str(job.id))
    return job


async def halt(op: Operator, experiment: models.Experiment) -> None:
    """End the experiment as halted, which is final."""
    phases.halt(op.session, experiment, f"halted by {op.who.name}")
    await audit.record(op.session, op.who, "experiment.halt", _target(experiment))


async def queue_job(op: Operator, experiment: models.Experiment, body: wire.JobCreate) -> models.Job:
    job = await phases.queue(op.session, op.settings, experiment, kinds.order_of(body))
    await audit.record(op.session, op.who, "job.queue", f"job:{job.id}", kind=body.kind, arm=body.arm, role=body.role)
    await phases.progress(op.session, op.settings, experiment)
    return job


async def stop_replica(op: Operator, experiment: models.Experiment, rank: int) -> models.Job:
    """Queue a replica-stop job on the host of the served arm's rank ``rank``."""
    plan = views.plan_of(experiment)
    if not plan.serves():
        raise Refused("serving-not-planned", f"plan {plan.name} serves no arm")
    order = kinds.order_of(wire.JobCreate(kind="replica-stop", arm=plan.served_arm(), spec={"rank": rank}))
    job = await phases.queue(op.session, op.settings, experiment, order)
    await audit.record(op.session, op.who, "replica.stop", f"job:{job.id}", rank=rank)
    return job


async def cancel(op: Operator, job: models.Job, grace: float) -> None:
    """Cancel a job: a queued one at once, a running one asked to stop and forced after ``grace`` seconds."""
    await reactions.cancel(op.session, op.settings, job, grace)
    await audit.record(op.session, op.who, "job.cancel", f"job:{job.id}", grace_seconds=grace)
