"""GET /metrics: the Prometheus scrape tells what the coordinator did (claims answered, a lease expired, uploads
refused) and what its database holds (jobs by kind and state, each agent's last contact), and only to an operator."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import models
from server.settings import Settings
from tests.integration.coordinator.support import Api, running
from tests.support.agent import rejection
from tests.support.database import make_token, with_session
from tests.support.scenarios import bearer
from tests.support.waiting import wait_for

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(http: httpx.Client, operator: str) -> Samples:
    response = http.get("/metrics", headers=bearer(operator))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _labelled(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (sample, labels), value in samples.items() if sample == name}


def _jobs_in_database(url: str) -> dict[tuple[str, str], int]:
    async def count(session: AsyncSession) -> dict[tuple[str, str], int]:
        rows = await session.execute(
            select(models.Job.kind, models.Job.state, func.count(models.Job.id)).group_by(
                models.Job.kind, models.Job.state
            )
        )
        return {(kind, state): int(n) for kind, state, n in rows}

    return with_session(url, count)


def _last_seen(url: str) -> dict[str, datetime.datetime]:
    async def read(session: AsyncSession) -> dict[str, datetime.datetime]:
        return {row.name: row.last_seen_at for row in await session.scalars(select(models.Agent))}

    return with_session(url, read)


def test_the_scrape_counts_claims_a_lease_expiry_and_refused_uploads_and_reads_jobs_and_agents_from_the_database(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    with running(make_settings(lease_seconds=0.6, heartbeat_seconds=0.2, reap_seconds=0.1)) as client:
        api = Api(client, database_url)
        a, b = api.agent("a"), api.agent("b")
        api.create_experiment()
        first = a.take("prepare")
        job_path = f"/api/jobs/{first.job_id}"
        # a never heartbeats: the reaper ends its lease and the job is queued again.
        wait_for(lambda: api.get(job_path)["attempts_made"] == 1 and api.get(job_path)["state"] == "queued", 10, "")
        late = rejection(a.events, first, 0, wire.Event(kind="output", body={"line": "late"}))
        assert late.status_code == 409 and late.rule == "attempt-already-ended"
        second = b.take("prepare")
        b.heartbeat(second)
        assert a.claim("prepare") is None  # the one queued job is b's now: an empty claim
        bad = api.http.put(
            f"/api/blobs/{'0' * 64}?attempt={second.attempt_id}", content=b"not that content", headers=bearer(b.token)
        )
        assert bad.status_code == 400
        unheld = api.http.post(f"/api/attempts/{second.attempt_id}/events", json={"lease_token": "x"})
        assert unheld.status_code == 401

        samples = _scrape(api.http, api.operator)

        jobs = _labelled(samples, "coop_jobs")
        in_database = _jobs_in_database(database_url)
        assert {dict(labels)["kind"] for labels in jobs} >= {"prepare", "train", "evaluate", "report"}
        for labels, value in jobs.items():
            assert value == in_database.get((dict(labels)["kind"], dict(labels)["state"]), 0), labels
        assert sum(jobs.values()) == sum(in_database.values()) > 0
        assert jobs[(("kind", "prepare"), ("state", "running"))] == 1

        claims = _labelled(samples, "coop_claim_seconds_count")
        assert claims == {(("outcome", "assigned"),): 2, (("outcome", "empty"),): 1}
        assert _labelled(samples, "coop_lease_expiries_total") == {(): 1}
        assert _labelled(samples, "coop_uploads_refused_total") == {
            (("reason", "attempt-already-ended"), ("upload", "events")): 1,
            (("reason", "bad-request"), ("upload", "blob")): 1,
            (("reason", "unauthenticated"), ("upload", "events")): 1,
        }
        seen = _last_seen(database_url)
        contacts = _labelled(samples, "coop_agent_last_contact_seconds")
        assert contacts == {(("agent", name),): pytest.approx(at.timestamp()) for name, at in seen.items()}
        assert set(seen) == {"a", "b"}


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer coop_not-a-token"}, 401),
        ({"Authorization": "Basic b3BlcmF0b3I="}, 401),
        ("agent", 403),
    ],
)
def test_the_scrape_needs_an_operator_token(api: Api, headers: dict[str, str] | str, status: int) -> None:
    sent: dict[str, Any] = bearer(make_token(api.url, "agent", "a")) if headers == "agent" else dict(headers)
    response = api.http.get("/metrics", headers=sent)
    assert response.status_code == status
    assert response.json()["status_code"] == status
    assert "coop_jobs" not in response.text


def test_two_apps_in_one_process_keep_their_own_series(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    with running(make_settings()) as one, running(make_settings()) as other:
        api = Api(one, database_url)
        assert api.agent("a").claim("prepare") is None
        assert _labelled(_scrape(one, api.operator), "coop_claim_seconds_count") == {(("outcome", "empty"),): 1}
        assert _labelled(_scrape(other, api.operator), "coop_claim_seconds_count") == {}
