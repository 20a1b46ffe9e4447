"""The experiments: the list, creating one from a plan, and each one's overview (states, ledger, deadline, cost)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from litestar import Controller, get, post
from litestar.datastructures import UploadFile
from litestar.enums import RequestEncodingType
from litestar.params import Body
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import audit, commitments, experiments
from server.errors import BadRequest
from server.lifecycle import EXPERIMENT_FINAL, ExperimentState
from server.settings import Settings
from server.web import access, queries, render
from server.web.access import WebRequest


@dataclass
class CreateForm:
    """The plan as pasted text or as a chosen file (the file wins when both are given)."""

    plan_toml: str = ""
    plan_file: UploadFile | None = None
    commit: str = ""


async def _status(db_session: AsyncSession, experiment_id: uuid.UUID) -> dict[str, Any]:
    experiment = await experiments.load(db_session, experiment_id)
    changes = await queries.timeline(db_session, experiment_id)
    return {
        "experiment": experiment,
        "live": ExperimentState(experiment.state) not in EXPERIMENT_FINAL,
        "changes": changes,
        "clock": queries.clock(experiment, changes),
        "ledger": await commitments.entries(db_session, experiment_id),
    }


class OverviewPages(Controller):
    path = "/"

    @get("/", name="home")
    async def home(self, request: WebRequest, db_session: AsyncSession) -> Template:
        return render.page(request, "experiments.html", experiments=await queries.experiment_list(db_session))

    @post("/experiments", opt=access.ACTION)
    async def create(
        self,
        request: WebRequest,
        data: Annotated[CreateForm, Body(media_type=RequestEncodingType.MULTI_PART)],
        db_session: AsyncSession,
        settings: Settings,
    ) -> Redirect:
        operator = access.operator(request)
        text = data.plan_toml
        if data.plan_file is not None and data.plan_file.filename:
            try:
                text = (await data.plan_file.read()).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadRequest(f"{data.plan_file.filename} is not UTF-8 text; choose the plan's .toml file") from exc
        if not text.strip():
            raise BadRequest("paste a plan or choose a plan file")
        try:
            body = msgspec.convert({"plan_toml": text, "commit": bool(data.commit)}, type=wire.ExperimentCreate)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"the plan cannot be used: {exc}") from exc
        experiment = await experiments.create(db_session, settings, body)
        audit.record(db_session, operator, "experiment.create", f"experiment:{experiment.id}", commit=body.commit)
        await db_session.commit()
        access.notify(request, f"created experiment {experiment.name} ({experiment.state})")
        return Redirect(f"/experiments/{experiment.id}", status_code=303)

    @get("/experiments/{experiment_id:uuid}", name="experiment")
    async def overview(self, request: WebRequest, experiment_id: uuid.UUID, db_session: AsyncSession) -> Template:
        return render.page(request, "overview.html", tab="overview", **await _status(db_session, experiment_id))

    @get("/experiments/{experiment_id:uuid}/status")
    async def status(self, request: WebRequest, experiment_id: uuid.UUID, db_session: AsyncSession) -> Template:
        return render.fragment(request, "fragments/status.html", **await _status(db_session, experiment_id))
