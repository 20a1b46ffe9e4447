"""Who may do what: public reads, operator writes, agents only on their own leases; every write audited."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.settings import Settings
from tests.integration.coordinator.support import Api, running
from tests.support.database import make_token, with_session
from tests.support.scenarios import LOCAL_PLAN, bearer


def test_auth_matrix(api: Api) -> None:
    post = api.client.post
    plan = {"plan_toml": LOCAL_PLAN.read_text()}
    a, b = api.agent("a"), api.agent("b")
    assert post("/api/experiments", json=plan).status_code == 401
    assert post("/api/experiments", json=plan, headers=bearer("coop_unknown")).status_code == 401
    assert post("/api/experiments", json=plan, headers={"Authorization": "Basic eDp5"}).status_code == 401
    assert post("/api/experiments", json=plan, headers=bearer(a.token)).status_code == 403
    assert post("/api/agents/claim", json={}, headers=bearer(api.operator)).status_code == 403
    assert post("/api/agents/claim", json={}).status_code == 401
    # An agent's route reads its token in its write transaction, after its body: still checked before the body is,
    # and the refusal ends that transaction (the claim below would wait for the write lock otherwise).
    malformed = {"attempt_ids": "not a list"}
    assert post("/api/agents/heartbeat", json=malformed, headers=bearer("coop_unknown")).status_code == 401
    assert post("/api/agents/heartbeat", json=malformed, headers=bearer(api.operator)).status_code == 403
    assert post("/api/agents/heartbeat", json=malformed, headers=bearer(a.token)).status_code == 400
    api.create_experiment()
    job = a.claim()
    assert job is not None
    stolen = post(
        f"/api/attempts/{job.attempt_id}/start", json={"lease_token": job.lease_token}, headers=bearer(b.token)
    )
    assert stolen.status_code == 403 and "another agent" in stolen.json()["detail"]
    forged = post(f"/api/attempts/{job.attempt_id}/start", json={"lease_token": "x" * 43}, headers=bearer(a.token))
    assert forged.status_code == 403
    unregistered = api.client.post("/api/agents/claim", json={}, headers=bearer(_agent_token(api, "c")))
    assert unregistered.status_code == 409 and unregistered.json()["rule"] == "agent-not-registered"
    assert api.client.get("/api/experiments").status_code == 200  # reads are public by default


def _agent_token(api: Api, name: str) -> str:
    return make_token(api.url, "agent", name)


def test_reads_need_a_token_when_public_read_is_off(make_settings: Callable[..., Settings], database_url: str) -> None:
    with running(make_settings(public_read=False)) as client:
        api = Api(client, database_url)
        assert client.get("/api/experiments").status_code == 401
        assert client.get("/api/experiments", headers=bearer(api.operator)).status_code == 200
        assert client.get("/api/agents", headers=bearer(api.agent("a").token)).status_code == 200
        assert client.get("/schema/openapi.json").status_code == 200
        # Liveness needs no token, even with reads closed, and says nothing but that the process answers.
        health = client.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_every_state_change_leaves_an_audit_row_and_a_heartbeat_none(api: Api) -> None:
    a = api.agent("a")
    api.create_experiment()
    job = a.claim()
    assert job is not None
    a.heartbeat(job)
    a.finish(job, result={"prepared_identity": "ab" * 32})
    a.finish(job, result={"prepared_identity": "ab" * 32})  # a replay writes nothing

    async def actions(session: AsyncSession) -> list[tuple[str, str]]:
        rows = await session.execute(select(models.AuditLog.actor, models.AuditLog.action).order_by(models.AuditLog.id))
        return [(actor, action) for actor, action in rows]

    assert with_session(api.url, actions) == [
        ("agent:a", "agent.register"),
        ("operator:operator", "experiment.create"),
        ("agent:a", "job.claim"),
        ("agent:a", "attempt.result"),
    ]

    async def count(session: AsyncSession) -> int:
        return int(await session.scalar(select(func.count()).select_from(models.IdempotentRequest)) or 0)

    assert with_session(api.url, count) == 1


def _row_counts(url: str) -> dict[str, int]:
    async def count(session: AsyncSession) -> dict[str, int]:
        return {
            table.name: int(await session.scalar(select(func.count()).select_from(table)) or 0)
            for table in models.UUIDv7AuditBase.metadata.sorted_tables
            if table.name != "alembic_version"
        }

    return with_session(url, count)


def test_a_reader_reads_every_route_and_metrics_and_writes_nothing(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    with running(make_settings(public_read=False)) as client:
        api = Api(client, database_url)
        reader = bearer(make_token(database_url, "reader", "analyst"))
        a = api.agent("a")
        experiment = api.create_experiment()["id"]
        job = a.claim()
        assert job is not None
        attempt = a.start(job)
        a.events(job, 1, wire.Event("step", {"done": 1, "total": 2}))
        ids = {
            "experiment_id": experiment,
            "job_id": str(job.job_id),
            "attempt_id": str(attempt.id),
            "sha256": "0" * 64,
        }
        before = _row_counts(database_url)
        schema = client.get("/schema/openapi.json", headers=reader).json()
        reads = writes = 0
        for template, operations in schema["paths"].items():
            path = template.format(**ids)
            for method in operations:
                if method in {"parameters", "summary", "description"}:
                    continue
                answer = client.request(method.upper(), path, headers=reader, json={})
                if method in {"get", "head"}:
                    reads += 1
                    # A reader reads everything; only the placeholder blob, the report not yet written and the
                    # canary never queued are absent.
                    absent = "{sha256}" in template or template.endswith(("/report", "/canary"))
                    expected = {404} if absent else {200}
                    assert answer.status_code in expected, (method, template, answer.text)
                    if template != "/health":  # liveness is open to all
                        assert client.request(method.upper(), path).status_code == 401, (method, template)
                else:
                    writes += 1
                    assert answer.status_code == 403, (method, template, answer.text)
                    assert "'analyst' is a reader token" in answer.json()["detail"]
        assert reads >= 15 and writes >= 15
        assert _row_counts(database_url) == before  # not even an audit row
        scrape = client.get("/metrics", headers=reader)
        assert scrape.status_code == 200 and "coop_jobs" in scrape.text
        assert client.get("/metrics").status_code == 401
