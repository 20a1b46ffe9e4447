"""The heartbeat: every few seconds the agent names the attempts it holds and its claim in flight, and the
coordinator answers with what it must stop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from agent.client import Coordinator, Rejected, Unreachable, Untrusted
from agent.leases import Leases
from agent.supervisor import Supervisor, _now

log = logging.getLogger("coop.agent")


class Heartbeat:
    def __init__(
        self,
        client: Coordinator,
        leases: Leases,
        supervisor: Supervisor,
        seconds: float,
        grace_seconds: float,
        distrust: Callable[[Untrusted], None],
    ) -> None:
        self.client, self.leases, self.supervisor = client, leases, supervisor
        self.seconds, self.grace_seconds, self.distrust = seconds, grace_seconds, distrust

    def loop(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.seconds):
            try:
                self.once()
            except Untrusted as exc:
                self.distrust(exc)

    def once(self) -> None:
        with self.leases.beating:
            request = self.leases.heartbeat()
            try:
                reply = self.client.heartbeat(request, retries=0)
            except (Unreachable, Rejected) as exc:
                log.warning("heartbeat: %s", exc)
                return
        for directive in reply.directives:
            if directive.action == "stop":
                grace = self.grace_seconds
                if directive.deadline is not None:
                    grace = max(0.0, (directive.deadline - _now()).total_seconds())
                self.supervisor.stop_attempt(
                    directive.attempt_id, directive.reason or "stopped by the coordinator", grace
                )
