"""The report as the coordinator recorded it: the primary verdict and its three conditions, every comparison,
the serving phases side by side with the served answers' agreement with the evaluation, and the report's own
figures, all read from the recorded report JSON."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import msgspec
from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.figures import SERVING_PHASES
from server import experiments
from server.errors import NotFound
from server.settings import Settings
from server.web import benchmarks, charts, render
from server.web.access import WebRequest


def serving_phases(document: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The serving section's metrics per phase, in the benchmark's order; empty when the report has none (a bundle
    without serving phases writes null, a report from before serving existed has no key at all)."""
    section = document.get("serving")
    phases = section.get("phases") if isinstance(section, Mapping) else None
    if not isinstance(phases, Mapping):
        return {}
    return {phase: phases[phase] for phase in SERVING_PHASES if isinstance(phases.get(phase), Mapping)}


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
        phases = serving_phases(document)
        return render.page(
            request,
            "report.html",
            tab="report",
            experiment=experiment,
            report=document,
            figures=charts.report(document),
            serving_phases=list(phases),
            serving_rows=benchmarks.comparison(phases),
        )
