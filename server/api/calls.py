"""What an agent's route works with, resolved as one dependency.

Litestar resolves a handler's dependencies of one level as tasks of a task group, and parses each one's arguments
through its own signature model. For the agent's frequent requests (claim, heartbeat, start, events, result) that is
a share of their CPU worth saving (docs/figures.md): one dependency, made from what the guard left on the request,
makes no task group and one parse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.di import NamedDependency
from sqlalchemy.ext.asyncio import AsyncSession

from server.access import auth
from server.access.tokens import Principal
from server.dispatch.queue import Caller
from server.prometheus import Metrics
from server.protocol.actions import Operator
from server.settings import Settings


@dataclass(frozen=True)
class AgentCall:
    """The request's database session (the one the guard began), the settings, the coordinator's metrics, the
    agent's token and the agent as the guard read them."""

    session: AsyncSession
    settings: Settings
    metrics: Metrics
    principal: Principal
    agent: Caller


def provider(metrics: Metrics) -> Callable[[Request[Any, Any, Any]], AgentCall]:
    def provide(request: Request[Any, Any, Any]) -> AgentCall:
        ctx = auth.context(request)
        principal = auth.provide_principal(request)
        return AgentCall(
            session=ctx.database.provide_session(request.app.state, request.scope),
            settings=ctx.settings,
            metrics=metrics,
            principal=principal,
            agent=auth.calling_agent(request, principal),
        )

    return provide


def operator(
    db_session: NamedDependency[AsyncSession],
    settings: NamedDependency[Settings],
    principal: NamedDependency[Principal],
) -> Operator:
    """An operator's route: who asks (the bearer token's principal), in the request's session."""
    return Operator(db_session, settings, principal)
