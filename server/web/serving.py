"""Serving: the pair's replicas (an operator stops a running one here: a replica-stop job on its host), and the
benchmark's three phases side by side, with the latency of every request and the failure phase's timeline
(server.web.benchmarks reads the recorded phase reports)."""

from __future__ import annotations

import uuid
from functools import partial

import anyio.to_thread
from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from server.protocol import actions, recording, replicas
from server.store import listings
from server.web import acting, benchmarks, gate, render
from server.web.forms import Confirmed
from server.web.gate import WebRequest


class ServingPages(Controller):
    path = "/experiments/{experiment_id:uuid}/serving"

    @get("/")
    async def serving(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        experiment = await recording.load(db_session, experiment_id)
        recorded = await listings.serving_results(db_session, experiment_id)
        running = sorted((await replicas.replicas(db_session, experiment_id)).values(), key=lambda r: r.rank)
        # Decoding the reports and drawing their figures is CPU work that would hold up every other request.
        found = await anyio.to_thread.run_sync(benchmarks.view, recorded)
        return render.page(
            request, "serving.html", tab="serving", experiment=experiment, serving=found, replicas=running
        )

    @post("/replicas/{rank:int}/stop", opt=gate.ACTION)
    async def stop(
        self,
        request: WebRequest,
        experiment_id: FromPath[uuid.UUID],
        rank: FromPath[int],
        data: Confirmed,
        operator: acting.Acting,
    ) -> Redirect | Template:
        experiment = await operator.experiment(experiment_id)
        back = f"/experiments/{experiment_id}/serving"
        explanation = (
            f"A replica-stop job is queued on rank {rank}'s host: its vLLM replica and probe finish the "
            "requests they hold and exit. A benchmark phase still to run needs both replicas and fails "
            "without this one."
        )
        path = f"{back}/replicas/{rank}/stop"
        ask = acting.Ask(f"Stop rank {rank}'s replica?", explanation, "Stop replica", "serving", experiment, path)
        stopping = partial(actions.stop_replica, operator, experiment, rank)
        message = f"queued replica-stop for rank {rank}"
        return await acting.confirmed(request, operator, data, ask, stopping, lambda _: message, back)
