"""Nothing wedges: each test drives a real `coop-server serve` process, on SQLite and on Postgres, the way a faulty
agent or host behaves, and checks that the coordinator ends in a state that recovers by itself."""

from __future__ import annotations

import datetime
import hashlib
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest

from agent.client import Coordinator as AgentClient
from agent.client import upload_key
from agent.loop import Agent as AgentLoop
from agent.loop import Settings as AgentSettings
from agent.spool import OpenAttempt, Spool
from agent.supervisor import to_event
from experiment import wire
from tests.support.agent import FakeAgent, answer, answers_file, rejection
from tests.support.database import empty_database, end_pooled_connections, make_token
from tests.support.processes import served
from tests.support.scenarios import bearer, create_experiment, operate, sha
from tests.support.waiting import wait_for


class Server:
    """One real coordinator process, its operator's token, and the fake agents a test registers with it."""

    def __init__(self, base: str, database_url: str) -> None:
        self.base = base
        self.url = database_url
        self.http = httpx.Client(base_url=base, timeout=60)
        self.operator = make_token(database_url, "operator", "operator")
        self.agents: list[FakeAgent] = []

    def agent(self, name: str) -> FakeAgent:
        agent = FakeAgent(self.base, make_token(self.url, "agent", name))
        self.agents.append(agent)
        agent.register("127.0.0.1")
        return agent

    def experiment(self) -> str:
        return str(create_experiment(self)["id"])

    def running(self, agent: FakeAgent) -> tuple[str, wire.Assignment]:
        """A new experiment, and its prepare job claimed and started by ``agent``."""
        experiment = self.experiment()
        return experiment, agent.take()

    def get(self, path: str) -> Any:
        response = self.http.get(path)
        assert response.status_code == 200, response.text
        return response.json()

    def attempt(self, job: wire.Assignment) -> dict[str, Any]:
        attempt: dict[str, Any] = self.get(f"/api/attempts/{job.attempt_id}")
        return attempt

    def close(self) -> None:
        for agent in self.agents:
            agent.close()
        self.http.close()


@pytest.fixture
def serve(database_url: str, tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start the coordinator with COOP_* settings (fast reaper by default); stopped when the test ends."""
    stack: list[tuple[Any, Server]] = []

    def start(**environment: str) -> Server:
        empty_database(database_url)
        context = served(database_url, tmp_path, **{"COOP_REAP_SECONDS": "0.1", **environment})
        server = Server(context.__enter__(), database_url)
        stack.append((context, server))
        return server

    yield start
    for context, server in reversed(stack):
        server.close()
        context.__exit__(None, None, None)


def _output(server: Server, job: wire.Assignment) -> list[str]:
    """The attempt's recorded output lines (its state changes are events too)."""
    events = server.get(f"/api/attempts/{job.attempt_id}/events")["items"]
    return [event["body"]["line"] for event in events if event["kind"] == "output"]


# 1. A lease nobody holds expires -----------------------------------------------------------------------------


def test_an_attempt_its_agent_does_not_name_is_lost_and_retried(serve: Callable[..., Server]) -> None:
    server = serve(COOP_LEASE_SECONDS="3", COOP_HEARTBEAT_SECONDS="0.5")
    a = server.agent("a")
    _, job = server.running(a)
    # The agent forgot the attempt (its result was refused, say) but heartbeats on with nothing named.
    for _ in range(3):
        a.heartbeat()
        time.sleep(0.2)
    attempt = server.attempt(job)
    assert attempt["state"] == "lost" and attempt["reason"].startswith("not held by its agent"), attempt
    state = server.get(f"/api/jobs/{job.job_id}")
    assert state["state"] == "queued" and state["attempts_made"] == 1  # retried, well within one lease
    retry = a.claim()
    assert retry is not None and retry.job_id == job.job_id and retry.number == 2


def test_a_named_attempt_keeps_its_lease_and_an_unnamed_one_of_the_same_agent_does_not(
    serve: Callable[..., Server],
) -> None:
    server = serve(COOP_LEASE_SECONDS="1.5", COOP_HEARTBEAT_SECONDS="0.3")
    a, b = server.agent("a"), server.agent("b")
    experiment = server.experiment()
    prepare = a.claim()
    assert prepare is not None
    a.finish(prepare, result={"prepared_identity": sha("prepared")})
    single_a, single_b = a.claim(), b.claim()
    assert single_a is not None and single_b is not None
    ends = time.monotonic() + 4  # past two leases
    while time.monotonic() < ends:
        assert a.heartbeat(single_a).directives[0].action == "continue"
        time.sleep(0.3)
    assert server.attempt(single_a)["state"] == "leased"
    assert server.attempt(single_b)["state"] == "lost"  # b never heartbeat: its lease expired
    assert server.get(f"/api/experiments/{experiment}")["state"] != "failed"


def test_a_retried_claim_gets_the_same_attempt_and_a_heartbeat_naming_the_claim_keeps_it(
    serve: Callable[..., Server],
) -> None:
    server = serve(COOP_LEASE_SECONDS="3", COOP_HEARTBEAT_SECONDS="0.5")
    a = server.agent("a")
    server.experiment()
    key = secrets.token_urlsafe(24)
    first = a.claim(key=key)
    assert first is not None
    # The reply was lost. Heartbeats while the claim is retried name the claim in flight, not an attempt.
    for _ in range(3):
        a.heartbeat(claiming=key)
        time.sleep(0.2)
    again = a.claim(key=key)
    assert again is not None and (again.attempt_id, again.job_id) == (first.attempt_id, first.job_id)
    assert again.lease_token != first.lease_token  # a new token: the lost reply's is refused
    assert rejection(a.start, first).status_code == 403
    a.start(again)
    attempts = server.get(f"/api/jobs/{first.job_id}/attempts")
    assert len(attempts) == 1 and attempts[0]["state"] == "running"
    # Once the attempt has started, the same key never hands out a second one.
    assert a.claim(key=key) is None


# 2. A slow upload cannot block the others ------------------------------------------------------------------


def _stalled_upload(
    base: str, token: str, job: wire.Assignment, route: str, sent: threading.Event, stop: threading.Event
) -> None:
    """An upload that sends its head and 16 bytes of its body and then waits, as a client on a dying link does: a
    PUT of a 1,024-byte blob, or a POST of an event batch (whose token the coordinator reads in the handler's write
    transaction, once the body is in)."""
    if route == "blob":
        data = bytes(1024)
        target = f"PUT /api/blobs/{hashlib.sha256(data).hexdigest()}?attempt={job.attempt_id}"
        fields = "Content-Type: application/octet-stream"
    else:
        batch = wire.EventBatch(lease_token=job.lease_token, sequence=0, events=[wire.Event("output", {"line": "x"})])
        data = msgspec.json.encode(batch)
        target = f"POST /api/attempts/{job.attempt_id}/events"
        fields = f"Content-Type: application/json\r\nIdempotency-Key: {job.job_id}:{job.attempt_id}:0"
    address = urlsplit(base)
    with socket.create_connection((address.hostname, address.port)) as sock:
        head = (
            f"{target} HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: {len(data)}\r\n"
            f"{fields}\r\n\r\n"
        )
        sock.sendall(head.encode() + data[:16])
        sent.set()
        stop.wait(60)


@pytest.mark.parametrize("route", ["blob", "events"])
def test_a_stalled_upload_blocks_no_other_request_and_no_reaper_round(serve: Callable[..., Server], route: str) -> None:
    server = serve(COOP_LEASE_SECONDS="2", COOP_HEARTBEAT_SECONDS="0.5")
    a, b = server.agent("a"), server.agent("b")
    server.experiment()
    job = a.claim()
    assert job is not None
    sent, stop = threading.Event(), threading.Event()
    uploader = threading.Thread(
        target=_stalled_upload, args=(server.base, a.token, job, route, sent, stop), daemon=True
    )
    uploader.start()
    try:
        assert sent.wait(10)
        time.sleep(0.5)  # the server has read the headers and is waiting for the rest of the body
        timings = {}
        for name, call in [
            ("heartbeat", lambda: a.heartbeat(job)),
            ("experiments", lambda: server.get("/api/experiments")),
            ("agents", lambda: server.get("/api/agents")),
            ("register", lambda: b.register("b")),
        ]:
            began = time.monotonic()
            call()  # each answers 2xx, or fails the test
            timings[name] = time.monotonic() - began
        assert max(timings.values()) < 3.0, timings  # none waits on the stalled upload
        # The reaper goes on too: with no more heartbeats, the attempt is lost when its 2 s lease ends.
        wait_for(lambda: server.attempt(job)["state"] == "lost", 10, "the reaper to end the lease")
    finally:
        stop.set()
        uploader.join(10)


# 3. Values the database cannot hold are refused at the schema ------------------------------------------------


def test_values_the_database_cannot_hold_are_refused_with_the_field_named_and_nothing_changes(
    serve: Callable[..., Server],
) -> None:
    server = serve()
    a = server.agent("a")
    experiment, job = server.running(a)

    def events(sequence: int, events: list[Any]) -> httpx.Response:
        """An event batch sent raw: the agent's client would never send these values."""
        body = {"lease_token": job.lease_token, "sequence": sequence, "events": events}
        headers = {**bearer(a.token), "Idempotency-Key": f"{job.job_id}:{job.attempt_id}:{sequence}"}
        return server.http.post(f"/api/attempts/{job.attempt_id}/events", json=body, headers=headers)

    def result(**fields: Any) -> httpx.Response:
        body = {"lease_token": job.lease_token, "outcome": "succeeded", "exit_code": 0, **fields}
        headers = {**bearer(a.token), "Idempotency-Key": f"{job.job_id}:{job.attempt_id}:result"}
        return server.http.post(f"/api/attempts/{job.attempt_id}/result", json=body, headers=headers)

    cases: list[tuple[httpx.Response, str]] = [
        (events(0, [{"kind": "output", "body": {"line": "a\u0000b"}}]), "$.events[0].body.line"),
        (events(0, [{"kind": "a\u0000b"}]), "$.events[0].kind"),
        (events(0, [{"kind": "x", "at": "2026-12-02T10:00:00"}]), "$.events[0].at"),
        (events(2**63, [{"kind": "x"}]), "$.sequence"),
        (events(2**31, [{"kind": "x"}]), "$.sequence"),
        (result(outcome="failed", reason="a\u0000b"), "$.reason"),
        (result(outcome="failed", exit_code=2**31), "$.exit_code"),
        (result(outcome="failed", exit_code=2**63), "$.exit_code"),
        (result(outcome="failed", journal=[_step(2**31)]), "$.journal[0].step"),
        (result(result={"prepared_identity": sha("p")}, answers=[_nul_answer()]), "$.answers[0].text"),
    ]
    for response, field in cases:
        assert response.status_code == 400, (field, response.status_code, response.text)
        assert field in response.json()["detail"], (field, response.json()["detail"])
    cursor = server.http.get(f"/api/experiments/{experiment}/answers?after=9223372036854775808")  # public
    assert cursor.status_code == 400 and "is not a cursor" in cursor.text
    assert server.attempt(job)["state"] == "running"
    assert _output(server, job) == []
    good = events(0, [{"kind": "output", "body": {"line": "a\ufffdb"}, "at": "2026-12-02T10:00:00Z"}])
    assert good.status_code == 201, good.text


def _step(step: int) -> dict[str, Any]:
    fields = ("loss", "learning_rate", "gradient_norm", "seconds")
    counts = ("targets", "weighted_targets", "documents")
    return (
        {"step": step, "positions": [0], "local_positions": [0]} | dict.fromkeys(fields, 0.5) | dict.fromkeys(counts, 1)
    )


def _nul_answer() -> dict[str, Any]:
    return answer(0, True) | {"text": "{\u0000}"}


def test_a_refused_upload_leaves_the_spool_and_the_uploads_after_it_arrive(
    serve: Callable[..., Server], tmp_path: Path
) -> None:
    server = serve()
    a = server.agent("a")
    _, job = server.running(a)
    spool = Spool(tmp_path / "agent" / "spool.sqlite3")
    client = AgentClient(server.base, a.token, retries=1, backoff=0.05)
    settings = AgentSettings(server.base, a.token, "a", "127.0.0.1", tmp_path / "agent", tmp_path, tmp_path)
    loop = AgentLoop(settings, client, spool)
    try:
        held = OpenAttempt(job.attempt_id, job.job_id, job.lease_token)
        spool.open_attempt(held.attempt_id, held.job_id, held.lease_token)
        spool.add_events(held, [wire.Event(kind="output", body={"line": "a\x00b"})])  # a value Postgres cannot hold
        spool.add_events(held, [wire.Event(kind="output", body={"line": "after"})])
        assert loop.uploader.send_pending()
        assert spool.counts() == {"rejected": 1, "acknowledged": 1}
        assert _output(server, job) == ["after"]
    finally:
        client.close()
        spool.close()


# 5. A report is only what the coordinator computed ----------------------------------------------------------


def test_an_operator_cannot_supply_a_report(serve: Callable[..., Server]) -> None:
    server = serve()
    experiment = server.experiment()
    path = f"/api/experiments/{experiment}/report"
    made_up = server.http.post(path, json={"verdict": "PASSED", "gain": 0.99}, headers=bearer(server.operator))
    assert made_up.status_code == 400 and "computes the report itself" in made_up.json()["detail"]
    early = server.http.post(path, headers=bearer(server.operator))
    assert early.status_code == 409 and early.json()["rule"] == "report-not-ready"
    assert server.get(f"/api/experiments/{experiment}")["state"] == "committed"
    assert server.http.get(path).status_code == 404


# 6. Nothing is accepted for an attempt that has ended ---------------------------------------------------------


def test_events_results_and_blobs_of_an_ended_attempt_get_409(serve: Callable[..., Server]) -> None:
    server = serve(COOP_LEASE_SECONDS="1", COOP_HEARTBEAT_SECONDS="0.2")
    a = server.agent("a")
    _, job = server.running(a)
    early = wire.Event(kind="output", body={"line": "early"}, at=datetime.datetime.now(datetime.UTC))
    accepted = a.events(job, 0, early)
    wait_for(lambda: server.attempt(job)["state"] == "lost", 10, "the lease to expire")
    retry = a.claim()
    assert retry is not None and retry.job_id == job.job_id
    a.start(retry)
    late = rejection(a.printed, job, 1, "late")
    assert late.status_code == 409 and late.rule == "attempt-already-ended", late
    assert a.events(job, 0, early) == accepted  # a replay of what was accepted still gets its stored reply
    blob = rejection(a.upload, b"late evidence\n", job)
    assert blob.status_code == 409 and blob.rule == "attempt-already-ended", blob
    data = b"late evidence\n"  # an upload that names no attempt: the agent's client never sends one
    unnamed = server.http.put(f"/api/blobs/{hashlib.sha256(data).hexdigest()}", content=data, headers=bearer(a.token))
    assert unnamed.status_code == 400 and "names its attempt" in unnamed.json()["detail"]
    result = rejection(a.finish, job, result={"prepared_identity": sha("p")})
    assert result.status_code == 409 and result.rule == "attempt-already-ended"
    assert _output(server, job) == ["early"]
    a.upload(b"evidence\n", retry)  # the retry's own evidence is taken


# 7. The published answers are the evidence's ------------------------------------------------------------------


def test_answers_their_hash_and_the_blob_must_agree(serve: Callable[..., Server]) -> None:
    server = serve()
    a = server.agent("a")
    experiment = server.experiment()
    prepare = a.claim()
    assert prepare is not None
    a.finish(prepare, result={"prepared_identity": sha("prepared")})
    operate(server, f"/api/experiments/{experiment}/jobs", {"kind": "evaluate", "arm": "seed", "role": "dev"})
    job = a.claim("evaluate")
    assert job is not None
    answers = [answer(0, True), answer(1, False)]
    data = answers_file(answers)
    digest = a.upload(data, job)
    path = "evaluations/dev/seed/answers.jsonl"
    altered = [answers[0], answer(1, True)]  # the rows would publish a correct answer the file holds as wrong
    for fields, reason in [
        ({"answers": answers, "result": {"answers_sha256": digest}}, "among its evidence"),
        ({"answers": answers, "result": {"answers_sha256": sha("x")}, "evidence": {path: digest}}, "answers_sha256"),
        ({"answers": altered, "result": {"answers_sha256": digest}, "evidence": {path: digest}}, "answers[1]"),
        ({"answers": answers[:1], "result": {"answers_sha256": digest}, "evidence": {path: digest}}, "holds 2"),
    ]:
        refused = rejection(a.finish, job, **fields)
        assert refused.status_code == 400 and reason in refused.detail, refused
    assert server.get(f"/api/experiments/{experiment}/answers")["total"] == 0
    assert server.attempt(job)["state"] == "leased"
    a.finish(job, answers=answers, result={"answers_sha256": digest}, evidence={path: digest})
    published = server.get(f"/api/experiments/{experiment}/answers?arm=seed&role=dev")["items"]
    assert [item["answer"] for item in published] == [json.loads(line) for line in data.splitlines()]


# 8. Each route takes bodies of its real size -----------------------------------------------------------------


def test_small_routes_refuse_large_bodies(serve: Callable[..., Server]) -> None:
    server = serve()
    token = make_token(server.url, "agent", "a")
    labels = {f"label{i}": "x" * 200 for i in range(10_000)}  # about 2 MB
    register = server.http.post("/api/agents/register", json={"address": "a", "labels": labels}, headers=bearer(token))
    assert register.status_code == 413, register.text
    many = {f"label{i}": "x" for i in range(33)}
    register = server.http.post("/api/agents/register", json={"address": "a", "labels": many}, headers=bearer(token))
    assert register.status_code == 400 and "$.labels" in register.json()["detail"]
    assert server.agent("b")
    heartbeat = server.http.post(
        "/api/agents/heartbeat", content=b'{"attempt_ids": []' + b" " * 2_000_000 + b"}", headers=bearer(token)
    )
    assert heartbeat.status_code == 413
    assert server.get("/api/agents")[0]["labels"] == {}


# 9. The OpenAPI document describes the service ----------------------------------------------------------------


def test_the_openapi_document_lists_statuses_tokens_bodies_and_bounds(serve: Callable[..., Server]) -> None:
    server = serve()
    document = server.get("/schema/openapi.json")
    assert set(document["components"]["securitySchemes"]) == {"operator", "agent", "reader"}
    for path, operations in document["paths"].items():
        if not path.startswith("/api/"):
            continue
        for method, operation in operations.items():
            codes = set(operation["responses"])
            assert {"400", "401"} <= codes, (method, path, codes)
            if method != "get":
                assert {"401", "403", "409", "413"} <= codes, (method, path, codes)
                assert operation["security"] and all(operation["security"]), (method, path)
    upload = document["paths"]["/api/blobs/{sha256}"]["put"]
    assert "application/octet-stream" in upload["requestBody"]["content"] and "201" in upload["responses"]
    schemas = document["components"]["schemas"]
    unbounded = [
        f"{name}.{field}"
        for name, schema in schemas.items()
        for field, value in schema.get("properties", {}).items()
        if _integer(value) and not ("maximum" in value and "minimum" in value) and name in _REQUEST_SCHEMAS
    ]
    assert unbounded == []
    # Measurements are typed: a step record or a resource sample, each with its attempt, rank, step and time.
    for name, carried in (("StepMeasurement", "StepRecord"), ("ResourceMeasurement", "ResourceSample")):
        fields = schemas[name]["properties"]
        assert {"attempt_id", "rank", "step", "at"} <= set(fields), (name, fields)
        assert carried in str(fields), (name, fields)
    switch = f"/api/experiments/{server.experiment()}/autopilot"
    for value in (0, "true", 1.0):
        refused = server.http.post(switch, json={"on": value}, headers=bearer(server.operator))
        assert refused.status_code == 400 and "$.on" in refused.json()["detail"], (value, refused.text)


_REQUEST_SCHEMAS = {
    "AttemptResult",
    "EventBatch",
    "StepRecord",
    "ResourceSample",
    "Answer",
    "ClaimRequest",
    "HeartbeatRequest",
    "AgentRegister",
    "SelectedArm",
    "SelectionCreate",
    "CancelRequest",
    "JobCreate",
    "ExperimentCreate",
}


def _integer(schema: dict[str, Any]) -> bool:
    kinds = [schema.get("type"), *(option.get("type") for option in schema.get("oneOf", []))]
    return "integer" in kinds


def test_a_fuzzer_over_the_openapi_document_finds_no_server_error() -> None:
    """Every operation, valid and invalid requests, as operator, agent and anonymous (tests/fuzz.py), each request
    sent to a coordinator on SQLite and to one on Postgres."""
    from tests.fuzz import run

    results = run(("sqlite", "postgres"), examples=5)
    assert [result["backend"] for result in results] == ["sqlite", "postgres"]
    for result in results:
        assert result["requests"] > 500 and result["server_errors"] == 0, result["first_server_errors"]
        assert {"400", "401", "403", "404", "409"} <= set(result["statuses"])
    # Each coordinator answered the same requests.
    assert results[0]["requests_by_role"] == results[1]["requests_by_role"]


# 10. A connection the database drops costs one retry ----------------------------------------------------------


@pytest.mark.parametrize("migrated_database", ["postgres"], indirect=True)
def test_a_connection_the_database_ends_costs_one_503_and_the_retry_is_kept_once(
    serve: Callable[..., Server],
) -> None:
    # No reaper or report round in the test's time: the test's request is the first to meet a dropped connection.
    server = serve(COOP_REAP_SECONDS="3600", COOP_CLAIM_RECHECK_SECONDS="3600")
    a = server.agent("a")
    _, job = server.running(a)
    a.printed(job, 0, "before")
    assert end_pooled_connections(server.url) >= 1

    batch = wire.EventBatch(lease_token=job.lease_token, sequence=1, events=[to_event("after")[0]])
    upload = {
        "url": f"/api/attempts/{job.attempt_id}/events",
        "content": msgspec.json.encode(batch),
        "headers": {**bearer(a.token), "Idempotency-Key": upload_key(job.job_id, job.attempt_id, 1)},
    }
    lost = server.http.post(**upload)
    assert lost.status_code == 503 and lost.headers["Retry-After"] == "1", lost.text
    assert "database" in lost.json()["detail"]
    kept, replay = server.http.post(**upload), server.http.post(**upload)
    assert kept.status_code == replay.status_code == 201, (kept.text, replay.text)
    assert replay.content == kept.content  # the stored reply: the batch was recorded once
    assert _output(server, job) == ["before", "after"]
    assert a.heartbeat(job).directives[0].action == "continue"
    assert server.attempt(job)["state"] == "running"
