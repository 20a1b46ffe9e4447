"""Attempts: the agent's start, event batches and result (idempotent uploads), and public reads."""

from __future__ import annotations

import uuid
from typing import Annotated

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, HeaderParameter, JSONBody, QueryParameter
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models, uploads
from server.access import audit
from server.api import spec
from server.api.calls import AgentCall
from server.dispatch import queue
from server.store import records, views
from server.store.idempotency import Stored

IdempotencyKey = Annotated[
    str | None, HeaderParameter(name="Idempotency-Key", description="job:attempt:sequence ('result' for results)")
]


MAX_EVENTS = records.MAX_EVENTS


async def _reply(
    call: AgentCall, stored: Stored, action: str, attempt_id: uuid.UUID, **detail: object
) -> Response[bytes]:
    """The stored reply to an upload; the upload is audited the first time only, not when a replay returns it."""
    if not stored.replay:
        await audit.record(call.session, call.principal, action, f"attempt:{attempt_id}", **detail)
    return Response(content=stored.body, status_code=stored.status_code, media_type="application/json")


class AttemptController(Controller):
    path = "/api/attempts"
    tags = ("attempts",)

    @get("/{attempt_id:uuid}", operation_id="getAttempt", **spec.read())
    async def get_attempt(
        self, attempt_id: FromPath[uuid.UUID], db_session: NamedDependency[AsyncSession]
    ) -> wire.Attempt:
        return views.attempt(await views.found(db_session, models.Attempt, attempt_id))

    @get("/{attempt_id:uuid}/events", operation_id="listAttemptEvents", **spec.read())
    async def list_events(
        self,
        attempt_id: FromPath[uuid.UUID],
        db_session: NamedDependency[AsyncSession],
        kind: Annotated[str | None, QueryParameter(max_length=100)] = None,
        after: Annotated[str | None, QueryParameter(max_length=64)] = None,
        limit: Annotated[int, QueryParameter(ge=1, le=MAX_EVENTS)] = MAX_EVENTS,
    ) -> wire.EventPage:
        """The attempt's events (what its command printed, its state changes) in the order recorded; ``after``: the
        next cursor of the page before, to follow a running attempt. A page ends at ``limit`` events or once its
        events pass MAX_PAGE_BYTES of JSON, whichever comes first; ``next`` then names the rest."""
        await views.found(db_session, models.Attempt, attempt_id)
        return await records.events(db_session, attempt_id, kind, after, limit)

    @post("/{attempt_id:uuid}/start", operation_id="startAttempt", **spec.write("agent"))
    async def start(
        self,
        attempt_id: FromPath[uuid.UUID],
        data: JSONBody[wire.LeaseProof],
        call: NamedDependency[AgentCall],
    ) -> wire.Attempt:
        attempt = await queue.start(call.session, call.agent, attempt_id, data.lease_token)
        await audit.record(call.session, call.principal, "attempt.start", f"attempt:{attempt_id}")
        await views.fresh(call.session, attempt)
        return views.attempt(attempt)

    @post(
        "/{attempt_id:uuid}/events",
        operation_id="uploadEvents",
        **spec.write("agent", body=None, upload="events"),
        status_code=201,
        response_description="wire.EventBatchReply; a replay returns the stored reply",
    )
    async def upload_events(
        self,
        attempt_id: FromPath[uuid.UUID],
        data: JSONBody[wire.EventBatch],
        call: NamedDependency[AgentCall],
        idempotency_key: IdempotencyKey = None,
    ) -> Response[bytes]:
        stored = await uploads.events(call.session, call.settings, call.agent, attempt_id, data, idempotency_key)
        return await _reply(call, stored, "attempt.events", attempt_id, sequence=data.sequence)

    @post(
        "/{attempt_id:uuid}/result",
        operation_id="uploadResult",
        **spec.write("agent", body=None, upload="result"),
        status_code=200,
        response_description="wire.Attempt; a replay returns the stored reply",
    )
    async def upload_result(
        self,
        attempt_id: FromPath[uuid.UUID],
        data: JSONBody[wire.AttemptResult],
        call: NamedDependency[AgentCall],
        idempotency_key: IdempotencyKey = None,
    ) -> Response[bytes]:
        stored = await uploads.result(call.session, call.settings, call.agent, attempt_id, data, idempotency_key)
        return await _reply(call, stored, "attempt.result", attempt_id, outcome=data.outcome)
