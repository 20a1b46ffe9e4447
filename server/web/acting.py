"""An operator's action from a page, written once: the confirmation page an irreversible action shows first, and
the action taken (the protocol's refusal rolled back and shown on the page it came from; a success committed and
announced), each answered with a redirect back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeAlias, TypeVar

from litestar.di import NamedDependency
from litestar.response import Redirect, Template
from sqlalchemy.ext.asyncio import AsyncSession

from server import models
from server.dispatch.lifecycle import Refused
from server.protocol.actions import Operator
from server.settings import Settings
from server.web import gate, render
from server.web.forms import Confirmation
from server.web.gate import WebRequest

T = TypeVar("T")
# The pages' ``operator`` dependency (server.web.routes provides it with ``operator`` below).
Acting: TypeAlias = NamedDependency[Operator]


def operator(
    request: WebRequest, db_session: NamedDependency[AsyncSession], settings: NamedDependency[Settings]
) -> Operator:
    """The signed-in operator, in the request's session (SignInRequired where nobody is): the pages' ``operator``
    dependency."""
    return Operator(db_session, settings, gate.operator(request))


@dataclass(frozen=True)
class Ask:
    """The confirmation page of an action on ``experiment``, shown under its ``tab``: its title, what the action
    does, its button's words, and the path its form posts ``confirm=yes`` to."""

    title: str
    explanation: str
    button: str
    tab: str
    experiment: models.Experiment
    action: str


def _confirmation(request: WebRequest, ask: Ask, back: str) -> Template:
    return render.page(
        request,
        "confirm.html",
        tab=ask.tab,
        experiment=ask.experiment,
        title=ask.title,
        explanation=ask.explanation,
        action=ask.action,
        fields={},
        button=ask.button,
        back=back,
    )


async def confirmed(
    request: WebRequest,
    operator: Operator,
    form: Confirmation,
    ask: Ask | None,
    action: Callable[[], Awaitable[T]],
    message: Callable[[T], str],
    back: str,
) -> Redirect | Template:
    """An irreversible action: ``ask``'s confirmation page until the form confirms it, then the action taken as
    ``act`` takes it (at once where ``ask`` is None: nothing to confirm)."""
    if ask is not None and form.confirm != "yes":
        return _confirmation(request, ask, back)
    return await act(request, operator, action(), message, back)


async def act(
    request: WebRequest, operator: Operator, action: Awaitable[T], message: Callable[[T], str], back: str
) -> Redirect:
    """Take ``action``: committed and announced with ``message`` of its result, or refused with nothing kept."""
    try:
        done = await action
    except Refused as exc:
        return await gate.refused(request, operator.session, exc.detail, back)
    await operator.session.commit()
    gate.notify(request, message(done))
    return Redirect(back, status_code=303)
