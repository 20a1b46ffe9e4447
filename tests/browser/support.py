"""An agent as the coordinator sees one, over its REST API: register, claim, start, send events, finish.

The browser tests drive the pages; this is how the work the pages show gets recorded, as a real agent
records it (the same endpoints, tokens, lease proofs and idempotency keys)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx

from server.lifecycle import EVALUATED_ARMS
from tests.integration.agent.support import Coordinator
from tests.integration.coordinator.support import LOCAL_PLAN, make_token, selection_body, train_result

T = TypeVar("T")


def off_thread(work: Callable[..., T], *args: Any) -> T:
    """Run ``work`` in a worker thread: Playwright's sync API keeps an event loop running in the test's thread,
    where the database helpers' ``asyncio.run`` refuses to start."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work, *args).result()


def sha(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


class Agent:
    def __init__(self, coordinator: Coordinator, name: str) -> None:
        self.http = coordinator.http
        self.token = off_thread(make_token, coordinator.database_url, "agent", name)
        self.headers = {"Authorization": f"Bearer {self.token}"}
        labels = {"hostname": f"{name}.hosts.test", "cpu_count": "2", "gpu_count": "0"}
        body = {"address": f"{name}.hosts.test", "labels": labels}
        self._ok(self.http.post("/api/agents/register", json=body, headers=self.headers))

    @staticmethod
    def _ok(response: httpx.Response) -> Any:
        assert response.status_code in {200, 201}, response.text
        return response.json()

    def claim(self, *kinds: str) -> dict[str, Any]:
        assignment = self.try_claim(*kinds)
        assert assignment is not None, f"no {kinds or 'job'} to claim"
        return assignment

    def try_claim(self, *kinds: str) -> dict[str, Any] | None:
        """Lease and start one job of these kinds, if one is queued for this agent."""
        body = {"wait_seconds": 0.5, "kinds": list(kinds) or None}
        assignment: dict[str, Any] | None = self._ok(
            self.http.post("/api/agents/claim", json=body, headers=self.headers)
        )["assignment"]
        if assignment is None:
            return None
        self._ok(
            self.http.post(
                f"/api/attempts/{assignment['attempt_id']}/start",
                json={"lease_token": assignment["lease_token"]},
                headers=self.headers,
            )
        )
        return assignment

    def events(self, job: dict[str, Any], sequence: int, *events: dict[str, Any]) -> None:
        """One batch of the command's output lines, as the agent forwards them (kind = the event's name)."""
        batch = {
            "lease_token": job["lease_token"],
            "sequence": sequence,
            "events": [{"kind": str(event.get("event", "output")), "body": event} for event in events],
        }
        key = f"{job['job_id']}:{job['attempt_id']}:{sequence}"
        self._ok(
            self.http.post(
                f"/api/attempts/{job['attempt_id']}/events",
                json=batch,
                headers={**self.headers, "Idempotency-Key": key},
            )
        )

    def finish(self, job: dict[str, Any], outcome: str = "succeeded", **fields: Any) -> None:
        body = {"lease_token": job["lease_token"], "outcome": outcome, "exit_code": 0 if outcome == "succeeded" else 1}
        key = f"{job['job_id']}:{job['attempt_id']}:result"
        self._ok(
            self.http.post(
                f"/api/attempts/{job['attempt_id']}/result",
                json={**body, **fields},
                headers={**self.headers, "Idempotency-Key": key},
            )
        )

    def upload(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        self._ok(self.http.put(f"/api/blobs/{digest}", content=data, headers=self.headers))
        return digest


def operator_post(coordinator: Coordinator, path: str, body: dict[str, Any]) -> Any:
    response = coordinator.http.post(path, json=body, headers={"Authorization": f"Bearer {coordinator.operator}"})
    assert response.status_code in {200, 201}, response.text
    return response.json()


def create_experiment(coordinator: Coordinator, autopilot: bool = True) -> dict[str, Any]:
    body = {"plan_toml": LOCAL_PLAN.read_text(), "commit": True, "autopilot": autopilot}
    return operator_post(coordinator, "/api/experiments", body)


def experiment_through_testing(coordinator: Coordinator) -> tuple[str, Agent, Agent]:
    """An experiment whose four test evaluations are committed, stepped by hand (autopilot off) by two agents
    (a holds the pair's rank 0, b its rank 1)."""
    experiment = create_experiment(coordinator, autopilot=False)["id"]
    a, b = Agent(coordinator, "host-a"), Agent(coordinator, "host-b")
    prepare = a.claim("prepare")
    a.finish(prepare, result={"prepared_identity": sha("prepared")})
    operator_post(coordinator, f"/api/experiments/{experiment}/advance", {})
    for agent in (a, b, a, b):  # the singles, then the pair's two ranks as one gang
        job = agent.claim("train")
        agent.finish(job, result=train_result(job["arm"]))
    operator_post(coordinator, f"/api/experiments/{experiment}/selection", selection_body())
    operator_post(coordinator, f"/api/experiments/{experiment}/advance", {})
    for _ in EVALUATED_ARMS:
        # A trained arm's evaluation runs on the host holding its checkpoint: either agent may get one.
        agent, job = next((agent, job) for agent in (a, b) if (job := agent.try_claim("evaluate")) is not None)
        agent.finish(job, result={"answers_sha256": sha(f"answers {job['arm']}")})
    return str(experiment), a, b


def step(arm: str, done: int, loss: float) -> dict[str, Any]:
    """A ``step`` event as ``coop train`` prints it (experiment.training)."""
    return {
        "event": "step",
        "arm": arm,
        "rank": 0,
        "done": done,
        "total": 128,
        "step": done,
        "loss": loss,
        "learning_rate": 1e-3,
        "gradient_norm": 1.0,
        "targets": 40,
        "weighted_targets": 320,
        "documents": 8,
        "seconds": 0.05,
    }
