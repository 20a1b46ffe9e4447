"""Serving: each benchmark phase's throughput, latency distribution, attempts and retries, as recorded.

The phase reports are the benchmark's own JSON (serving/PHASE.json of the bundle); the page shows their
scalar fields as they are and draws every latency it finds, so that it follows the report's fields."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from litestar import Controller, get
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import experiments, results
from server.lifecycle import JOB_ACTIVE, JobState
from server.web import charts, queries, render
from server.web.access import WebRequest

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
    async def serving(self, request: WebRequest, experiment_id: uuid.UUID, db_session: AsyncSession) -> Template:
        experiment = await experiments.load(db_session, experiment_id)
        phases = [phase(result) for result in await results.serving_results(db_session, experiment_id)]
        replicas = [
            job
            for job in await queries.jobs(db_session, experiment_id)
            if job.kind == "replica-start" and JobState(job.state) in {JobState.QUEUED, *JOB_ACTIVE}
        ]
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
