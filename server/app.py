"""The coordinator's Litestar application, assembled in ``create_app``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from advanced_alchemy.extensions.litestar import AsyncSessionConfig, SQLAlchemyAsyncConfig, SQLAlchemyPlugin
from litestar import Litestar, MediaType, Request, Response, get
from litestar.datastructures import ResponseHeader, State
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig
from litestar.types import Scope
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from experiment import wire
from experiment.core.errors import CoopError
from experiment.core.states import JobState
from server import db, failpoints, reporter
from server.access import auth
from server.api import calls, spec
from server.api.agents import AgentController
from server.api.attempts import AttemptController
from server.api.blobs import BlobController
from server.api.evidence import EvidenceController
from server.api.experiments import ExperimentController
from server.api.jobs import JobController
from server.api.metrics import scrape
from server.api.results import ResultController
from server.dispatch import queue, waiters
from server.dispatch.lifecycle import Refused
from server.httperrors import (
    BadRequest,
    Forbidden,
    IdempotencyConflict,
    InsufficientStorage,
    NotFound,
    TooLarge,
    Unauthenticated,
)
from server.prometheus import Metrics
from server.protocol import reactions
from server.settings import Settings, from_env
from server.store import blobstore, bodies
from server.web import routes as web_routes
from server.web import template_config as web_templates

log = logging.getLogger("coop.server")

_STATUS: dict[type[CoopError], int] = {
    NotFound: 404,
    Unauthenticated: 401,
    Forbidden: 403,
    BadRequest: 400,
    IdempotencyConflict: 409,
    Refused: 409,
    TooLarge: 413,
    InsufficientStorage: 507,
    CoopError: 400,
}


# The reason a refused upload is counted under (server.prometheus) when no protocol rule names it.
_REASONS = {
    400: "bad-request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not-found",
    409: "conflict",
    413: "too-large",
    507: "insufficient-storage",
}


def _status(exc: Exception) -> int:
    return next((code for kind, code in _STATUS.items() if isinstance(exc, kind)), 400)


def _rule(exc: Exception) -> str | None:
    if isinstance(exc, Refused):
        return exc.rule
    return "idempotency-key-reused" if isinstance(exc, IdempotencyConflict) else None


def _problem(_: Request[object, object, State], exc: Exception) -> Response[wire.Problem]:
    status = _status(exc)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(
        wire.Problem(status, str(exc), _rule(exc)), status_code=status, media_type=MediaType.JSON, headers=headers
    )


def _database_error(_: Request[object, object, State], exc: DBAPIError) -> Response[wire.Problem]:
    """A connection the database dropped (it restarted) is 503 with Retry-After: the request's transaction ended
    with it, committed or not, and its retry under the same keys (as agents retry) meets a new connection and gets
    the one answer. Any other database error is the coordinator's own, logged as a server error."""
    if not exc.connection_invalidated:
        log.error("a request failed in the database", exc_info=exc)
        return Response(wire.Problem(500, "Internal Server Error"), status_code=500, media_type=MediaType.JSON)
    detail = "the coordinator lost its connection to the database; retry the request"
    return Response(wire.Problem(503, detail), status_code=503, media_type=MediaType.JSON, headers={"Retry-After": "1"})


def _count_refused_uploads(metrics: Metrics) -> Callable[[Exception, Scope], Awaitable[None]]:
    """A hook on every exception a request raised: an upload (a route marked ``spec.UPLOAD``) answered with a
    4xx, or with 507 when the blob store's disk is full, is counted, under its protocol rule or its status's name.
    Litestar's own refusals (a body over the route's limit, a malformed path) are counted with ours."""

    async def count(exc: Exception, scope: Scope) -> None:
        handler = scope.get("route_handler")
        upload = handler.opt.get(spec.UPLOAD) if handler is not None else None
        if upload is None:
            return
        if isinstance(exc, CoopError):
            status, rule = _status(exc), _rule(exc)
        elif isinstance(exc, HTTPException) and 400 <= exc.status_code < 500:
            status, rule = exc.status_code, None
        else:
            return  # not a refusal: an error of the coordinator's own
        metrics.uploads_refused.labels(upload, rule or _REASONS.get(status, f"http-{status}")).inc()

    return count


@get("/health", operation_id="health", tags=("health",), opt={"public": True}, security=[{}])
async def health() -> wire.Health:
    """Liveness, for a load balancer or an operator: always public, no token, no database."""
    return wire.Health()


async def _reaper(settings: Settings, sessions: async_sessionmaker[AsyncSession], metrics: Metrics) -> None:
    """Look for expired leases every ``reap_seconds``; an error is logged and the loop goes on."""
    async with sessions() as session, session.begin():
        await queue.renew_after_restart(session, settings)
    while True:
        await asyncio.sleep(settings.reap_seconds)
        try:
            async with sessions() as session, session.begin():
                ended = await reactions.reap(session, settings)
        except Exception:  # the reaper must outlive a failed round (a dropped connection, a lock timeout)
            log.exception("reaper round failed; retrying in %ss", settings.reap_seconds)
            continue
        # Counted once the round's transaction committed: a round rolled back expired nothing.
        metrics.lease_expiries.inc(sum(1 for item in ended if item.attempt and item.attempt.state == JobState.LOST))


def _background(
    settings: Settings, sessions: async_sessionmaker[AsyncSession], woken: waiters.Claims, metrics: Metrics
) -> Callable[[Litestar], contextlib.AbstractAsyncContextManager[None]]:
    """The coordinator's own tasks while the app serves: the reaper, the report worker and, on Postgres, the
    listener that wakes claims for jobs other coordinator processes queue."""

    @contextlib.asynccontextmanager
    async def background(_: Litestar) -> AsyncIterator[None]:
        # What the process made to start (modules, the app, the ORM's mappers) lives as long as it does. Frozen out
        # of the collector's reach, it is not walked by every full collection, which would otherwise stall the event
        # loop for about 200 ms each time (once a second while reads list 256 experiments). Garbage is collected first,
        # and the collector gets everything back when the app stops (an app run inside another process, as in tests).
        gc.collect()
        gc.freeze()
        tasks = [
            asyncio.create_task(_reaper(settings, sessions, metrics)),
            asyncio.create_task(reporter.loop(sessions, settings, woken)),
        ]
        if not db.is_sqlite(settings.database_url):
            tasks.append(asyncio.create_task(waiters.listen(settings.database_url, woken)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            # A task cancelled inside a database call cleans up its connection; that must not hold the app's stop
            # (seen once: a Postgres app's stop in a test never returned). What has not ended by then is left.
            _ended, pending = await asyncio.wait(tasks, timeout=STOP_SECONDS)
            for task in pending:
                log.warning("background task %s did not end within %ss of the stop", task.get_name(), STOP_SECONDS)
            gc.unfreeze()

    return background


STOP_SECONDS = 10.0  # how long the app's stop waits for its background tasks
HSTS_SECONDS = 365 * 24 * 3600


def _headers(settings: Settings) -> list[ResponseHeader]:
    """Headers on every answer: no browser guesses a type for what the coordinator serves (blobs are uploaded data),
    frames it in another page, or tells another site which page linked to it; over TLS, a browser that has been here
    comes back over TLS only. The web UI's pages add their Content-Security-Policy (server.web)."""
    headers = [
        ResponseHeader(name="X-Content-Type-Options", value="nosniff"),
        ResponseHeader(name="X-Frame-Options", value="DENY"),
        ResponseHeader(name="Referrer-Policy", value="same-origin"),
    ]
    if settings.tls:
        headers.append(ResponseHeader(name="Strict-Transport-Security", value=f"max-age={HSTS_SECONDS}"))
    return headers


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or from_env()
    failpoints.arm(settings.failpoints)
    blobstore.clear_incoming(settings)
    if db.is_sqlite(settings.database_url):
        settings.home.mkdir(parents=True, exist_ok=True)
    engine = db.create_engine(settings.database_url)
    woken = waiters.Claims()
    config = SQLAlchemyAsyncConfig(
        engine_instance=engine,
        # advanced-alchemy's file-object and cache listeners serve columns and caches this coordinator does not
        # have; switched off (the first is never registered, the second returns at once), a flush and a commit no
        # longer look for them (a tenth of a claim's CPU).
        session_config=AsyncSessionConfig(
            expire_on_commit=False, info={waiters.CLAIMS: woken, "enable_cache_listener": False}
        ),
        enable_file_object_listener=False,
        before_send_handler="autocommit",
    )
    sessions = config.create_session_maker()
    assert isinstance(sessions, async_sessionmaker)
    context = auth.Context(settings, sessions, config)
    metrics = Metrics()
    return Litestar(
        route_handlers=[
            ExperimentController,
            JobController,
            AgentController,
            AttemptController,
            ResultController,
            EvidenceController,
            BlobController,
            health,
            scrape,
            *web_routes(settings),
        ],
        plugins=[SQLAlchemyPlugin(config=config)],
        dependencies={
            "settings": Provide(lambda: settings, use_cache=True, sync_to_thread=False),
            "principal": Provide(auth.provide_principal, sync_to_thread=False),
            "metrics": Provide(lambda: metrics, use_cache=True, sync_to_thread=False),
            auth.CALL: Provide(calls.provider(metrics), sync_to_thread=False),
            "operator": Provide(calls.operator, sync_to_thread=False),
        },
        guards=[auth.authorize],
        before_request=bodies.before_request,
        exception_handlers={CoopError: _problem, DBAPIError: _database_error},
        after_exception=[_count_refused_uploads(metrics)],
        template_config=web_templates(),
        lifespan=[_background(settings, sessions, woken, metrics)],
        state=State({auth.STATE_KEY: context}),
        request_max_body_size=settings.max_body_bytes,
        response_headers=_headers(settings),
        openapi_config=OpenAPIConfig(
            title="coop coordinator", version="0.1.0", path="/schema", components=spec.SECURITY_SCHEMES
        ),
    )
