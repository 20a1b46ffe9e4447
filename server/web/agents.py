"""The agents: heartbeat age, host facts (their labels) and what each runs now."""

from __future__ import annotations

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from server.settings import Settings
from server.store import pages
from server.web import render
from server.web.gate import WebRequest


class AgentPages(Controller):
    path = "/agents"

    @get(["/", "/live"])
    async def agents(
        self, request: WebRequest, db_session: NamedDependency[AsyncSession], settings: NamedDependency[Settings]
    ) -> Template:
        rows = await pages.agents(db_session)
        return render.page_or_live(request, "agents.html", agents=rows, lease_seconds=settings.lease_seconds)
