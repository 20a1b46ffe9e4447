"""The report as the coordinator recorded it: the primary verdict and its three conditions, every comparison,
and the report's own figures, all read from the recorded report JSON."""

from __future__ import annotations

import uuid

import msgspec
from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from server import experiments
from server.errors import NotFound
from server.settings import Settings
from server.web import charts, render
from server.web.access import WebRequest


class ReportPages(Controller):
    path = "/experiments/{experiment_id:uuid}/report"

    @get("/")
    async def report(
        self,
        request: WebRequest,
        experiment_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> Template:
        experiment = await experiments.load(db_session, experiment_id)
        try:
            path = await experiments.report_file(db_session, settings, experiment_id)
        except NotFound:
            return render.page(request, "report.html", tab="report", experiment=experiment, report=None, figures={})
        document = msgspec.json.decode(path.read_bytes())
        return render.page(
            request,
            "report.html",
            tab="report",
            experiment=experiment,
            report=document,
            figures=charts.report(document),
        )
