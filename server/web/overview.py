"""The experiments: the list, creating one from a plan, and each one's overview (states, ledger, deadline, cost) with
the operator's actions on it: advance, autopilot and halt."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import partial

import msgspec
from litestar import Controller, get, post
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency
from litestar.params import FromPath, MultipartBody, URLEncodedBody
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from experiment.core.states import ExperimentState
from server.httperrors import BadRequest
from server.protocol import actions, canaries, recording
from server.store import commitments, pages
from server.web import acting, gate, render
from server.web.forms import Confirmed, Switch
from server.web.gate import WebRequest


@dataclass
class CreateForm:
    """The plan as pasted text or as a chosen file (the file wins when both are given)."""

    plan_toml: str = ""
    plan_file: UploadFile | None = None
    commit: str = ""
    autopilot: str = ""


# Advancing from these states queues a step that cannot be taken back; the operator confirms it first.
IRREVERSIBLE = {
    ExperimentState.TRAINED: (
        "From trained, advancing queues the dev evaluations and then, on the next advance, the selection of "
        "each trained arm's final checkpoint. Once the selection is committed it is final: no other checkpoint "
        "of these arms can be evaluated on the test tasks."
    ),
    ExperimentState.SELECTED: (
        "From selected, advancing queues the test evaluations of the four arms. Their answers are recorded "
        "once and never replaced: this is the experiment's one look at the test tasks."
    ),
}


async def _status(db_session: AsyncSession, experiment_id: uuid.UUID) -> dict[str, object]:
    experiment = await recording.load(db_session, experiment_id)
    changes = await pages.timeline(db_session, experiment_id)
    clock = pages.clock(experiment, changes)
    ledger = await commitments.entries(db_session, experiment_id)
    return render.experiment_context(experiment, changes=changes, clock=clock, ledger=ledger)


class OverviewPages(Controller):
    path = "/"

    @get("/")
    async def home(self, request: WebRequest, db_session: NamedDependency[AsyncSession]) -> Template:
        return render.page(request, "experiments.html", experiments=await pages.experiment_list(db_session))

    @post("/experiments", opt=gate.ACTION)
    async def create(self, request: WebRequest, data: MultipartBody[CreateForm], operator: acting.Acting) -> Redirect:
        text = data.plan_toml
        if data.plan_file is not None and data.plan_file.filename:
            try:
                text = (await data.plan_file.read()).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadRequest(f"{data.plan_file.filename} is not UTF-8 text; choose the plan's .toml file") from exc
        if not text.strip():
            raise BadRequest("paste a plan or choose a plan file")
        fields = {"plan_toml": text, "commit": bool(data.commit), "autopilot": bool(data.autopilot)}
        try:
            body = msgspec.convert(fields, type=wire.ExperimentCreate)
        except msgspec.ValidationError as exc:
            raise BadRequest(f"the plan cannot be used: {exc}") from exc
        experiment = await actions.create(operator, body)
        await operator.session.commit()
        gate.notify(request, f"created experiment {experiment.name} ({experiment.state})")
        return Redirect(f"/experiments/{experiment.id}", status_code=303)

    @get("/experiments/{experiment_id:uuid}")
    async def overview(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        # The canary shows on the page, not in the status fragment that the page polls.
        canary = await canaries.latest(db_session, experiment_id)
        shown = None if canary is None else canaries.view(canary)
        status = await _status(db_session, experiment_id)
        return render.page(request, "overview.html", tab="overview", canary=shown, **status)

    @get("/experiments/{experiment_id:uuid}/status")
    async def status(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        return render.fragment(request, "fragments/status.html", **await _status(db_session, experiment_id))

    @post("/experiments/{experiment_id:uuid}/advance", opt=gate.ACTION)
    async def advance(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], data: Confirmed, operator: acting.Acting
    ) -> Redirect | Template:
        experiment = await operator.experiment(experiment_id)
        back = f"/experiments/{experiment_id}"
        ask = None
        if (warning := IRREVERSIBLE.get(experiment.state)) is not None:
            title = f"Advance {experiment.name} from {experiment.state}?"
            ask = acting.Ask(title, warning, "Advance", "overview", experiment, f"{back}/advance")
        advancing = partial(actions.advance, operator, experiment)
        return await acting.confirmed(request, operator, data, ask, advancing, str, back)

    @post("/experiments/{experiment_id:uuid}/halt", opt=gate.ACTION)
    async def halt(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], data: Confirmed, operator: acting.Acting
    ) -> Redirect | Template:
        """As the API's halt: the experiment ends as halted, which is final."""
        experiment = await operator.experiment(experiment_id)
        back = f"/experiments/{experiment_id}"
        explanation = (
            f"The experiment ends as halted, from {experiment.state}, as the API's halt ends it: no agent is "
            "handed another of its jobs, no phase follows and no report is computed. The ledger, answers "
            "and evidence stay as recorded."
        )
        ask = acting.Ask(
            f"Halt {experiment.name}?", explanation, "Halt experiment", "overview", experiment, f"{back}/halt"
        )
        name = experiment.name
        halting = partial(actions.halt, operator, experiment)
        return await acting.confirmed(request, operator, data, ask, halting, lambda _: f"halted {name}", back)

    @post("/experiments/{experiment_id:uuid}/autopilot", opt=gate.ACTION)
    async def autopilot(
        self,
        request: WebRequest,
        experiment_id: FromPath[uuid.UUID],
        data: URLEncodedBody[Switch],
        operator: acting.Acting,
    ) -> Redirect:
        """As the API's switch: turned on, autopilot advances at once if the current phase is done."""
        experiment = await operator.experiment(experiment_id)
        back = f"/experiments/{experiment_id}"
        state = "on" if data.value else "off"
        return await acting.act(
            request,
            operator,
            actions.set_autopilot(operator, experiment, data.value),
            lambda advanced: f"autopilot {state}" + (f"; {advanced}" if advanced else ""),
            back,
        )
