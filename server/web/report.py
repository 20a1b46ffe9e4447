"""The report as the coordinator recorded it: the primary verdict and its three conditions, every comparison,
the serving phases side by side with the served answers' agreement with the evaluation, and the report's own
figures, all read from the recorded report JSON; and each paired comparison's wins and losses, item by item."""

from __future__ import annotations

import uuid

import msgspec
from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.report.model import Report, read_report
from experiment.serving.servingrecord import PHASES
from server.httperrors import NotFound
from server.protocol import recording
from server.settings import Settings
from server.web import charts, paired, render
from server.web.gate import WebRequest


async def recorded(db_session: AsyncSession, settings: Settings, experiment_id: uuid.UUID) -> Report:
    """The recorded report, decoded; NotFound (with why) where there is none, or none this coordinator reads."""
    path = await recording.report_file(db_session, settings, experiment_id)
    try:
        return read_report(path.read_bytes())
    except msgspec.ValidationError as exc:
        raise NotFound(
            f"the recorded report is not in the shape this coordinator reads ({exc}); its JSON is at "
            f"/api/experiments/{experiment_id}/report"
        ) from None


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
        experiment = await recording.load(db_session, experiment_id)
        try:
            path = await recording.report_file(db_session, settings, experiment_id)
        except NotFound:
            return render.page(request, "report.html", tab="report", experiment=experiment, report=None, figures={})
        try:
            document = read_report(path.read_bytes())
        except msgspec.ValidationError as exc:
            # A report recorded in another shape than this coordinator's: shown as its JSON, never a 500.
            return render.page(
                request, "report.html", tab="report", experiment=experiment, report=None, figures={}, problem=str(exc)
            )
        return render.page(
            request,
            "report.html",
            tab="report",
            experiment=experiment,
            report=document,
            figures=charts.report(document),
            phases=PHASES,
            comparisons={(c.arm, c.baseline): c for c in paired.stated(document)},
        )

    @get("/compare/{arm:str}/vs/{baseline:str}")
    async def compare(
        self,
        request: WebRequest,
        experiment_id: FromPath[uuid.UUID],
        arm: FromPath[str],
        baseline: FromPath[str],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> Template:
        experiment = await recording.load(db_session, experiment_id)
        document = await recorded(db_session, settings, experiment_id)
        comparison = paired.find(document, arm, baseline)
        found = await paired.discordant(db_session, experiment_id, baseline, arm)
        return render.page(
            request,
            "compare.html",
            tab="report",
            experiment=experiment,
            comparison=comparison,
            comparisons=paired.stated(document),
            found=found,
            agrees=found.agrees(comparison),
        )
