"""The benchmark's client against two real HTTP endpoints on loopback: one answers, the other stops answering
mid-request as a cut link does (its in-flight request and its health checks hang). The client abandons the
attempt in flight as soon as its health check fails, and retries it on the survivor: nothing is lost, and
nothing waits for the hung connection."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from experiment.core.plan import ServingPlan
from experiment.serving.benchmark import PhaseRun

HUNG_SECONDS = 60.0  # longer than the test: an answer after it would show the client waited for the hung link


class Endpoint(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.cut = threading.Event()  # from now on nothing is answered
        self.release = threading.Event()  # the test's end: hung handlers return
        self.hold_infer = False  # its requests hang from the first (the link is cut while they are in flight)
        # A stopped vLLM replica drains: it refuses new requests, its health check fails once on a loaded host,
        # then answers 200 again until it exits.
        self.draining = False
        self.health_failures = 0
        self.infers: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Endpoint

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _reply(self, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        if self.server.cut.is_set():
            self.server.release.wait(HUNG_SECONDS)
            return
        if self.server.draining and self.server.health_failures == 0:
            self.server.health_failures += 1
            self._refuse()
            return
        self._reply({"status": "ok"})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.infers.append(request["request_id"])
        if self.server.hold_infer or self.server.cut.is_set():
            self.server.release.wait(HUNG_SECONDS)
            return
        if self.server.draining:
            self._refuse()
            return
        check = {"correct": True, "valid_json_object": True, "reason": "correct"}
        self._reply(
            {
                "request_id": request["request_id"],
                "task_id": request["task_id"],
                "model": "m",
                "output_ids": [1, 2],
                "text": "{}",
                "ended_with_eos": True,
                "hit_token_limit": False,
                "check": check,
                "cached": False,
                "replica_seconds": 0.01,
            }
        )


@pytest.fixture
def endpoints() -> Iterator[tuple[Endpoint, Endpoint]]:
    pair = (Endpoint(), Endpoint())
    for endpoint in pair:
        threading.Thread(target=endpoint.serve_forever, daemon=True).start()
    yield pair
    for endpoint in pair:
        endpoint.release.set()
        endpoint.shutdown()
        endpoint.server_close()


def test_an_attempt_in_flight_to_an_endpoint_that_goes_down_is_retried_on_the_survivor(
    endpoints: tuple[Endpoint, Endpoint],
) -> None:
    survivor, cut = endpoints
    cut.hold_infer = True
    events: list[dict[str, object]] = []
    plan = ServingPlan(workload_tasks=4, concurrency=2, max_attempts=2, retry_cache_size=8, max_new_tokens=8)
    run = PhaseRun([survivor.url, cut.url], "token", plan, ["t0", "t1", "t2", "t3"], events.append, "pair")

    async def scenario() -> float:
        phase = asyncio.create_task(run.run())
        while not cut.infers:  # a request is in flight to the endpoint: now its link is cut
            await asyncio.sleep(0.01)
        cut.cut.set()
        return await asyncio.wait_for(phase, 30)

    duration = asyncio.run(scenario())
    assert not run.failures and len(run.completions) == 4
    assert {c.endpoint for c in run.completions} == {survivor.url}
    abandoned = [a for a in run.attempts if a.endpoint == cut.url]
    assert abandoned and all(a.status is None for a in abandoned)
    assert {a.error for a in abandoned} == {"abandoned in flight: the endpoint went down"}
    retried = {c.request_id: c.attempts for c in run.completions if c.request_id in {a.request_id for a in abandoned}}
    assert sorted(retried) == sorted(a.request_id for a in abandoned) and set(retried.values()) == {2}
    # Given up once a health check (2 s timeout) failed, not when the hung connections would have ended.
    assert all(a.ended - a.started < 5 for a in abandoned) and duration < 10
    assert [e["endpoint"] for e in events if e["event"] == "endpoint-down"] == [cut.url]


def test_a_stopped_replica_whose_health_check_answers_again_gets_no_request_after_it_was_seen_leaving(
    endpoints: tuple[Endpoint, Endpoint],
) -> None:
    survivor, stopped = endpoints
    events: list[dict[str, object]] = []

    def emit(event: dict[str, object]) -> None:
        events.append(event)
        if event["event"] == "stop-replica":  # the coordinator stops the second replica
            stopped.draining = True

    plan = ServingPlan(workload_tasks=8, concurrency=2, max_attempts=2, retry_cache_size=8, max_new_tokens=8)
    run = PhaseRun([survivor.url, stopped.url], "token", plan, [f"t{n}" for n in range(8)], emit, "failure")
    run.stop_after = 2
    asyncio.run(asyncio.wait_for(run.run(), 30))
    assert not run.failures and len(run.completions) == 8
    assert stopped.health_failures == 1 and run.stop_seen is not None and run.stopped == stopped.url
    after = [a for a in run.attempts if a.started >= run.stop_seen]
    assert len(after) >= 8 - 2 - plan.concurrency
    assert all(a.endpoint == survivor.url and a.status == 200 for a in after)
    assert not [e for e in events if e["event"] == "endpoint-up"]
