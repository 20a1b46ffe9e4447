"""The coordinator's Litestar application, assembled in ``create_app``."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator, Callable

from advanced_alchemy.extensions.litestar import AsyncSessionConfig, SQLAlchemyAsyncConfig, SQLAlchemyPlugin
from litestar import Litestar, MediaType, Request, Response, get
from litestar.datastructures import ResponseHeader, State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from experiment import wire
from experiment.core.errors import CoopError
from server import auth, bodies, claims, db, queue, reactions, reporter
from server.api import spec
from server.api.agents import AgentController
from server.api.attempts import AttemptController
from server.api.blobs import BlobController
from server.api.evidence import EvidenceController
from server.api.experiments import ExperimentController
from server.api.jobs import JobController
from server.api.results import ResultController
from server.errors import BadRequest, Forbidden, IdempotencyConflict, NotFound, TooLarge, Unauthenticated
from server.lifecycle import Refused
from server.settings import Settings, from_env
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
    CoopError: 400,
}


def _problem(_: Request[object, object, State], exc: Exception) -> Response[wire.Problem]:
    status = next((code for kind, code in _STATUS.items() if isinstance(exc, kind)), 400)
    rule = (
        exc.rule
        if isinstance(exc, Refused)
        else "idempotency-key-reused"
        if isinstance(exc, IdempotencyConflict)
        else None
    )
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(
        wire.Problem(status, str(exc), rule), status_code=status, media_type=MediaType.JSON, headers=headers
    )


@get("/health", operation_id="health", tags=("health",), opt={"public": True}, security=[{}])
async def health() -> wire.Health:
    """Liveness, for a load balancer or an operator: always public, no token, no database."""
    return wire.Health()


async def _reaper(settings: Settings, sessions: async_sessionmaker[AsyncSession]) -> None:
    """Look for expired leases every ``reap_seconds``; an error is logged and the loop goes on."""
    async with sessions() as session, session.begin():
        await queue.renew_after_restart(session, settings)
    while True:
        await asyncio.sleep(settings.reap_seconds)
        try:
            async with sessions() as session, session.begin():
                await reactions.ended(session, settings, await queue.reap(session, settings))
        except Exception:  # the reaper must outlive a failed round (a dropped connection, a lock timeout)
            log.exception("reaper round failed; retrying in %ss", settings.reap_seconds)


def _background(
    settings: Settings, sessions: async_sessionmaker[AsyncSession], woken: claims.Claims
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
            asyncio.create_task(_reaper(settings, sessions)),
            asyncio.create_task(reporter.loop(sessions, settings, woken)),
        ]
        if not db.is_sqlite(settings.database_url):
            tasks.append(asyncio.create_task(claims.listen(settings.database_url, woken)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            gc.unfreeze()

    return background


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or from_env()
    if db.is_sqlite(settings.database_url):
        settings.home.mkdir(parents=True, exist_ok=True)
    engine = db.create_engine(settings.database_url)
    woken = claims.Claims(take_turns=db.is_sqlite(settings.database_url))
    config = SQLAlchemyAsyncConfig(
        engine_instance=engine,
        session_config=AsyncSessionConfig(expire_on_commit=False, info={claims.CLAIMS: woken}),
        before_send_handler="autocommit",
    )
    sessions = config.create_session_maker()
    assert isinstance(sessions, async_sessionmaker)
    context = auth.Context(settings, sessions, config)
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
            *web_routes(settings),
        ],
        plugins=[SQLAlchemyPlugin(config=config)],
        dependencies={
            "settings": Provide(lambda: settings, use_cache=True, sync_to_thread=False),
            "principal": Provide(auth.provide_principal, sync_to_thread=False),
            "agent": Provide(auth.provide_agent, sync_to_thread=False),
        },
        guards=[auth.authorize],
        before_request=bodies.before_request,
        exception_handlers={CoopError: _problem},
        template_config=web_templates(),
        lifespan=[_background(settings, sessions, woken)],
        state=State({auth.STATE_KEY: context}),
        request_max_body_size=settings.max_body_bytes,
        # No browser guesses a type for what the coordinator serves (blobs are uploaded data).
        response_headers=[ResponseHeader(name="X-Content-Type-Options", value="nosniff")],
        openapi_config=OpenAPIConfig(
            title="coop coordinator", version="0.1.0", path="/schema", components=spec.SECURITY_SCHEMES
        ),
    )
