"""The arms: each trained arm's progress per rank, its update times and the live loss curve."""

from __future__ import annotations

import uuid

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from server.protocol import recording
from server.web import charts, progress, render
from server.web.gate import WebRequest


async def _training(db_session: AsyncSession, experiment_id: uuid.UUID) -> dict[str, object]:
    experiment = await recording.load(db_session, experiment_id)
    arms = await progress.training(db_session, experiment)
    losses = charts.losses({arm.name: arm.losses for arm in arms})
    return render.experiment_context(experiment, arms=arms, losses=losses)


class TrainingPages(Controller):
    path = "/experiments/{experiment_id:uuid}/arms"

    @get(["/", "/live"])
    async def arms(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        return render.page_or_live(request, "arms.html", tab="arms", **await _training(db_session, experiment_id))
