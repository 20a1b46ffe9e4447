"""``GET /metrics``: the coordinator's Prometheus metrics (server.prometheus), for an operator or a reader token.

Not a public read: the scrape names every agent and when it was last heard from. Prometheus sends a bearer token
from a file (``authorization: credentials_file``): a reader token of its own, made with
``coop-server token create --role reader --name prometheus``, reads and can be revoked alone."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from litestar.di import NamedDependency
from sqlalchemy.ext.asyncio import AsyncSession

from server.api import spec
from server.prometheus import Metrics, jobs_by_state, last_contacts
from server.settings import Settings
from server.store import blobstore


@get(
    "/metrics",
    operation_id="metrics",
    tags=("metrics",),
    media_type="text/plain",
    response_description="Prometheus' text exposition format (OpenMetrics when the Accept header asks for it)",
    **spec.private_read("operator", "reader"),
)
async def scrape(
    request: Request[Any, Any, Any],
    db_session: NamedDependency[AsyncSession],
    metrics: NamedDependency[Metrics],
    settings: NamedDependency[Settings],
) -> Response[bytes]:
    jobs = await jobs_by_state(db_session)
    agents = await last_contacts(db_session)
    body, content_type = metrics.exposition(
        jobs, agents, blobstore.free_bytes(settings), request.headers.get("accept", "")
    )
    return Response(body, media_type=content_type)
