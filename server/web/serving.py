"""Serving: the pair's replicas (an operator stops a running one here: a replica-stop job on its host), and each
benchmark phase's throughput, latency distribution, attempts and retries, as recorded.

The phase reports are the benchmark's own JSON (serving/PHASE.json of the bundle); the page shows their
scalar fields as they are and draws every latency it finds, so that it follows the report's fields."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import audit, experiments, results, serving
from server.lifecycle import Refused
from server.settings import Settings
from server.web import access, charts, render
from server.web.access import WebRequest
from server.web.forms import Confirmation

Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class Phase:
    result: wire.ServingResult
    fields: list[tuple[str, Scalar]]
    latencies: list[float]


def _scalars(report: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Scalar]]:
    for key, value in report.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}.")
        elif not isinstance(value, list):
            yield f"{prefix}{key}", value


def _latencies(value: Any, key: str = "") -> Iterator[float]:
    """Every number under a key that names a latency, in lists and in per-request records alike."""
    if isinstance(value, dict):
        for name, inner in value.items():
            yield from _latencies(inner, name)
    elif isinstance(value, list):
        for inner in value:
            yield from _latencies(inner, key)
    elif "latenc" in key and isinstance(value, int | float) and not isinstance(value, bool):
        yield float(value)


def phase(result: wire.ServingResult) -> Phase:
    return Phase(result, list(_scalars(result.report)), list(_latencies(result.report)))


class ServingPages(Controller):
    path = "/experiments/{experiment_id:uuid}/serving"

    @get("/")
    async def serving(
        self, request: WebRequest, experiment_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> Template:
        experiment = await experiments.load(db_session, experiment_id)
        phases = [phase(result) for result in await results.serving_results(db_session, experiment_id)]
        replicas = sorted((await serving.replicas(db_session, experiment_id)).values(), key=lambda r: r.rank)
        return render.page(
            request,
            "serving.html",
            tab="serving",
            experiment=experiment,
            phases=phases,
            replicas=replicas,
            latency=charts.distributions(
                "Request latency by phase", {p.result.phase: p.latencies for p in phases}, "seconds"
            ),
        )

    @post("/replicas/{rank:int}/stop", opt=access.ACTION)
    async def stop(
        self,
        request: WebRequest,
        experiment_id: FromPath[uuid.UUID],
        rank: FromPath[int],
        data: URLEncodedBody[Confirmation],
        db_session: NamedDependency[AsyncSession],
        settings: NamedDependency[Settings],
    ) -> Redirect | Template:
        operator = access.operator(request)
        experiment = await experiments.load(db_session, experiment_id, lock=True)
        back = f"/experiments/{experiment_id}/serving"
        if data.confirm != "yes":
            return render.page(
                request,
                "confirm.html",
                tab="serving",
                experiment=experiment,
                title=f"Stop rank {rank}'s replica?",
                explanation=(
                    f"A replica-stop job is queued on rank {rank}'s host: its vLLM replica and probe finish the "
                    "requests they hold and exit. A benchmark phase still to run needs both replicas and fails "
                    "without this one."
                ),
                action=f"{back}/replicas/{rank}/stop",
                fields={},
                button="Stop replica",
                back=back,
            )
        try:
            job = await serving.enqueue(db_session, settings, experiment, "replica-stop", {"rank": rank})
        except Refused as exc:
            return await access.refused(request, db_session, exc.detail, back)
        audit.record(db_session, operator, "replica.stop", f"job:{job.id}", rank=rank)
        await db_session.commit()
        access.notify(request, f"queued replica-stop for rank {rank}")
        return Redirect(back, status_code=303)
