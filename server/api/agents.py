"""Agents: register, heartbeat (lease renewal and stop directives) and claim (long poll)."""

from __future__ import annotations

import datetime
import time

from litestar import Controller, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server.access import audit
from server.access.tokens import Principal
from server.api import spec
from server.api.calls import AgentCall
from server.dispatch import queue, waiters
from server.protocol import kinds, reactions
from server.store import records, views


class AgentController(Controller):
    path = "/api/agents"
    tags = ("agents",)

    @get("/", operation_id="listAgents", **spec.read(found=False))
    async def list_agents(self, db_session: NamedDependency[AsyncSession]) -> list[wire.Agent]:
        return await records.agents(db_session)

    @post("/register", operation_id="registerAgent", **spec.write("agent", found=False))
    async def register(
        self,
        data: JSONBody[wire.AgentRegister],
        db_session: NamedDependency[AsyncSession],
        principal: NamedDependency[Principal],
    ) -> wire.Agent:
        """One agent per agent token; registering again updates its addresses and labels (each registration is
        an audit row)."""
        agent = await records.register(
            db_session, principal.name, principal.token_id, data, datetime.datetime.now(datetime.UTC)
        )
        await audit.record(
            db_session,
            principal,
            "agent.register",
            f"agent:{principal.name}",
            address=data.address,
            private_address=data.private_address,
        )
        await views.fresh(db_session, agent)
        return views.agent(agent)

    @post("/heartbeat", operation_id="heartbeat", status_code=200, **spec.write("agent", found=False))
    async def heartbeat(
        self, data: JSONBody[wire.HeartbeatRequest], call: NamedDependency[AgentCall]
    ) -> wire.HeartbeatReply:
        return await reactions.heartbeat(call.session, call.settings, call.agent, data.attempt_ids, data.claiming)

    @post("/claim", operation_id="claimJob", status_code=200, **spec.write("agent", found=False))
    async def claim(self, data: JSONBody[wire.ClaimRequest], call: NamedDependency[AgentCall]) -> wire.ClaimReply:
        """Lease one rank of one job, waiting up to ``wait_seconds`` for one to be queued (server.dispatch.waiters)."""
        db_session, settings, metrics = call.session, call.settings, call.metrics
        arrived = time.monotonic()
        deadline = arrived + min(data.wait_seconds, settings.max_claim_wait_seconds)
        # Agents run every kind but the coordinator's own (server.reporter), or those they ask for among them.
        wanted = [name for name in kinds.BY_AGENTS if data.kinds is None or name in data.kinds]
        waiting = waiters.of(db_session)
        while True:
            ticket = waiting.ticket()
            assignment = await queue.claim(db_session, settings, call.agent, wanted, data.claim_key)
            if assignment is not None:
                await audit.record(
                    db_session, call.principal, "job.claim", f"attempt:{assignment.attempt_id}", rank=assignment.rank
                )
            await db_session.commit()  # a claim that waits holds no transaction
            if assignment is not None:
                metrics.claim_seconds.labels("assigned").observe(time.monotonic() - arrived)
                return wire.ClaimReply(kinds.hand_out(settings, assignment), settings.heartbeat_seconds)
            if time.monotonic() >= deadline:
                metrics.claim_seconds.labels("empty").observe(time.monotonic() - arrived)
                return wire.ClaimReply(None, settings.heartbeat_seconds)
            await waiting.wait(ticket, min(settings.claim_recheck_seconds, deadline - time.monotonic()))
