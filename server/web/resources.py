"""Resources: per host, every attempt's resident memory, CPU use and GPU memory over time (server.web.samples),
redrawn while the experiment runs, since samples arrive as an attempt runs."""

from __future__ import annotations

import uuid

import anyio.to_thread
from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from server.protocol import recording
from server.web import render, samples
from server.web.gate import WebRequest

POLL_SECONDS = 10  # the figures are redrawn for every new sample: less often than the text parts


async def _resources(db_session: AsyncSession, experiment_id: uuid.UUID) -> dict[str, object]:
    experiment = await recording.load(db_session, experiment_id)
    found = await samples.sampled(db_session, experiment_id)
    # Drawing the figures is CPU work that would hold up every other request.
    drawn = await anyio.to_thread.run_sync(samples.view, found)
    return render.experiment_context(experiment, resources=drawn, every=POLL_SECONDS)


class ResourcePages(Controller):
    path = "/experiments/{experiment_id:uuid}/resources"

    @get(["/", "/live"])
    async def resources(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        context = await _resources(db_session, experiment_id)
        return render.page_or_live(request, "resources.html", tab="resources", **context)
