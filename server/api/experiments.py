"""Experiments: create from a plan, read, and the operator's protocol steps (selection, serving, report)."""

from __future__ import annotations

import uuid
from typing import Any

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from litestar.response import File
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.api import spec
from server.httperrors import BadRequest, NotFound
from server.protocol import actions, canaries, recording
from server.protocol.actions import Operator
from server.settings import Settings
from server.store import commitments, records, views


async def _view(operator: Operator, experiment: models.Experiment) -> wire.Experiment:
    await views.fresh(operator.session, experiment)
    return views.experiment(experiment)


class ExperimentController(Controller):
    path = "/api/experiments"
    tags = ("experiments",)

    @post("/", operation_id="createExperiment", **spec.write("operator", body=spec.PLAN, found=False))
    async def create(
        self,
        data: JSONBody[wire.ExperimentCreate],
        operator: NamedDependency[Operator],
    ) -> wire.Experiment:
        experiment = await actions.create(operator, data)
        return await _view(operator, experiment)

    @get("/", operation_id="listExperiments", **spec.read(found=False))
    async def list_experiments(self, db_session: NamedDependency[AsyncSession]) -> list[wire.Experiment]:
        return await records.experiments(db_session)

    @get("/{experiment_id:uuid}", operation_id="getExperiment", **spec.read())
    async def get_experiment(
        self, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> wire.Experiment:
        return views.experiment(await recording.load(db_session, experiment_id))

    @post("/{experiment_id:uuid}/commit", operation_id="commitPlan", **spec.write("operator"))
    async def commit(
        self,
        experiment_id: FromPath[uuid.UUID],
        data: JSONBody[wire.PlanCommit],
        operator: NamedDependency[Operator],
    ) -> wire.Experiment:
        """Commit a draft's plan: 409 ``canary-required`` for a GPU plan whose canary has not passed, unless the
        body's ``canary_override`` gives the operator's reason, which the plan's commitment records."""
        experiment = await operator.experiment(experiment_id)
        await actions.commit(operator, experiment, data)
        return await _view(operator, experiment)

    @get("/{experiment_id:uuid}/arms", operation_id="listArms", **spec.read())
    async def arms(
        self, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> list[wire.Arm]:
        await recording.load(db_session, experiment_id)
        arms = await recording.arms_of(db_session, experiment_id)
        return [views.arm(arms[name]) for name in sorted(arms)]

    @get("/{experiment_id:uuid}/ledger", operation_id="getLedger", **spec.read())
    async def ledger(
        self, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> list[wire.LedgerEntry]:
        await recording.load(db_session, experiment_id)
        return await commitments.entries(db_session, experiment_id)

    @get("/{experiment_id:uuid}/jobs", operation_id="listExperimentJobs", **spec.read())
    async def jobs(
        self, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> list[wire.Job]:
        await recording.load(db_session, experiment_id)
        return await records.jobs(db_session, experiment_id)

    @post("/{experiment_id:uuid}/jobs", operation_id="queueJob", **spec.write("operator", body=spec.DOCUMENT))
    async def queue_job(
        self,
        experiment_id: FromPath[uuid.UUID],
        data: JSONBody[wire.JobCreate],
        operator: NamedDependency[Operator],
    ) -> wire.Job:
        experiment = await operator.experiment(experiment_id)
        job = await actions.queue_job(operator, experiment, data)
        await views.fresh(operator.session, job)
        return views.job(job)

    @post(
        "/{experiment_id:uuid}/selection", operation_id="commitSelection", **spec.write("operator", body=spec.DOCUMENT)
    )
    async def selection(
        self,
        experiment_id: FromPath[uuid.UUID],
        data: JSONBody[wire.SelectionCreate],
        operator: NamedDependency[Operator],
    ) -> wire.Experiment:
        experiment = await operator.experiment(experiment_id)
        await actions.select(operator, experiment, data)
        return await _view(operator, experiment)

    @post("/{experiment_id:uuid}/advance", operation_id="advanceExperiment", status_code=200, **spec.write("operator"))
    async def advance(
        self,
        experiment_id: FromPath[uuid.UUID],
        operator: NamedDependency[Operator],
    ) -> wire.Advanced:
        """Queue the next phase's jobs (409 with rule ``phase-running`` while the current phase runs)."""
        experiment = await operator.experiment(experiment_id)
        action = await actions.advance(operator, experiment)
        return wire.Advanced(await _view(operator, experiment), action)

    @post("/{experiment_id:uuid}/autopilot", operation_id="setAutopilot", status_code=200, **spec.write("operator"))
    async def autopilot(
        self,
        experiment_id: FromPath[uuid.UUID],
        data: JSONBody[wire.AutopilotSet],
        operator: NamedDependency[Operator],
    ) -> wire.Experiment:
        """Switch autopilot on or off; switched on, it advances at once if the current phase is done."""
        experiment = await operator.experiment(experiment_id)
        await actions.set_autopilot(operator, experiment, data.on)
        return await _view(operator, experiment)

    @post("/{experiment_id:uuid}/serving", operation_id="commitServing", **spec.write("operator"))
    async def serving(
        self,
        experiment_id: FromPath[uuid.UUID],
        data: JSONBody[wire.ServingCreate],
        operator: NamedDependency[Operator],
    ) -> wire.Experiment:
        experiment = await operator.experiment(experiment_id)
        await actions.serve(operator, experiment, data)
        return await _view(operator, experiment)

    @post("/{experiment_id:uuid}/report", operation_id="requestReport", **spec.write("operator"))
    async def report(
        self,
        experiment_id: FromPath[uuid.UUID],
        request: Request[Any, Any, Any],
        operator: NamedDependency[Operator],
    ) -> wire.Job:
        """Ask the coordinator to compute the report from the stored evidence (it queues its own report job).
        The request has no body: a report is only ever the coordinator's recomputation, never one sent to it."""
        if (await request.body()).strip():
            raise BadRequest("a report request has no body: the coordinator computes the report itself")
        experiment = await operator.experiment(experiment_id)
        job = await actions.request_report(operator, experiment)
        await views.fresh(operator.session, job)
        return views.job(job)

    @get("/{experiment_id:uuid}/report", operation_id="getReport", media_type="application/json", **spec.read())
    async def get_report(
        self,
        experiment_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> File:
        """The report JSON the coordinator computed and committed (404 until then)."""
        await recording.load(db_session, experiment_id)
        path = await recording.report_file(db_session, settings, experiment_id)
        return File(path, media_type="application/json", content_disposition_type="inline")

    @get("/{experiment_id:uuid}/canary", operation_id="getCanary", **spec.read())
    async def canary(
        self, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> wire.Canary:
        """The experiment's latest canary, host by host and step by step (404 while none was queued)."""
        await recording.load(db_session, experiment_id)
        verdict = await canaries.latest(db_session, experiment_id)
        if verdict is None:
            raise NotFound(f"experiment {experiment_id} has no canary: queue a canary job while it is a draft")
        return canaries.view(verdict)

    @post("/{experiment_id:uuid}/halt", operation_id="haltExperiment", **spec.write("operator"))
    async def halt(
        self,
        experiment_id: FromPath[uuid.UUID],
        operator: NamedDependency[Operator],
    ) -> wire.Experiment:
        experiment = await operator.experiment(experiment_id)
        await actions.halt(operator, experiment)
        return await _view(operator, experiment)
