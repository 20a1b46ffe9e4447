"""The coordinator as deployed: `coop-server` processes (migrate, token, serve, verify-ledger) over real HTTP,
32 concurrent claimers against a uvicorn server, and a tampered ledger caught by verify-ledger."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession

from server import migrate, models
from tests.support import database, processes
from tests.support.database import empty_database, make_token, with_session
from tests.support.scenarios import LOCAL_PLAN, bearer
from tests.support.waiting import wait_for

CLAIMERS = 32
JOBS = 24


def coop_server(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server", *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def server_env(database_url: str, tmp_path: Path) -> dict[str, str]:
    empty_database(database_url)
    return {**os.environ, "COOP_HOME": str(tmp_path), "COOP_DATABASE_URL": database_url}


@pytest.fixture
def served(database_url: str, tmp_path: Path) -> Iterator[str]:
    empty_database(database_url)
    with processes.served(database_url, tmp_path) as base:
        yield base


def test_fresh_sqlite_server_answers_schema_and_commits_a_plan(tmp_path: Path) -> None:
    """The issue's must-show: migrate a fresh SQLite file, make a token, serve, create from plans/local.toml."""
    env = {**os.environ, "COOP_HOME": str(tmp_path / "home")}
    env.pop("COOP_DATABASE_URL", None)
    # Before migrate, a token has no table to go to: refused, naming the command, and no home or database is made
    # (one made by root before the coordinator's unit first starts would be root's, not coop's).
    early = coop_server(env, "token", "create", "--role", "operator", "--name", "op")
    assert early.returncode == 2 and "run `coop-server migrate` first" in early.stderr, early.stderr
    assert "Traceback" not in early.stderr and not (tmp_path / "home").exists()
    assert coop_server(env, "migrate").returncode == 0
    created = coop_server(env, "token", "create", "--role", "operator", "--name", "op")
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("coop_") and "shown once" in created.stderr
    duplicate = coop_server(env, "token", "create", "--role", "operator", "--name", "op")
    assert duplicate.returncode == 2 and "already exists" in duplicate.stderr
    port = processes.free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port)], env=env, stderr=subprocess.DEVNULL
    )
    try:
        base = f"http://127.0.0.1:{port}"

        def answered() -> httpx.Response | None:
            try:
                return httpx.get(f"{base}/schema/openapi.json", timeout=1)
            except httpx.TransportError:
                return None

        schema = wait_for(answered, 60, "the coordinator to answer")
        assert schema.status_code == 200 and "createExperiment" in schema.text
        response = httpx.post(
            f"{base}/api/experiments", json={"plan_toml": LOCAL_PLAN.read_text()}, headers=bearer(token), timeout=10
        )
        assert response.status_code == 201, response.text
        experiment = response.json()
        ledger = httpx.get(f"{base}/api/experiments/{experiment['id']}/ledger", timeout=10).json()
        assert [(e["seq"], e["kind"], e["identity"]) for e in ledger] == [(1, "plan", experiment["plan_identity"])]
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert (tmp_path / "home" / "coordinator.sqlite3").is_file()
    verified = coop_server(env, "verify-ledger", experiment["id"])
    assert verified.returncode == 0 and '"verified": true' in verified.stdout


def test_tampered_ledger_is_detected_naming_the_seq(server_env: dict[str, str], database_url: str) -> None:
    from server.settings import Settings
    from tests.integration.coordinator.support import Api, running

    with running(Settings(home=Path(server_env["COOP_HOME"]), database_url=database_url)) as client:
        api = Api(client, database_url)
        a = api.agent("a")
        experiment = api.create_experiment()
        job = a.claim()
        assert job is not None
        a.finish(job, result={"prepared_identity": "ab" * 32})
    assert coop_server(server_env, "verify-ledger", experiment["id"]).returncode == 0

    async def tamper(session: AsyncSession) -> None:
        await session.execute(
            update(models.Commitment)
            .where(models.Commitment.seq == 2, models.Commitment.experiment_id == _uuid(experiment["id"]))
            .values(body={"plan_identity": "f" * 64})
        )

    with_session(database_url, tamper)
    caught = coop_server(server_env, "verify-ledger", experiment["id"])
    assert caught.returncode == 2 and "ledger seq 2" in caught.stderr and "altered" in caught.stderr


def _uuid(text: str) -> Any:
    import uuid

    return uuid.UUID(text)


def test_concurrent_claimers_never_double_claim(served: str, database_url: str) -> None:
    operator = make_token(database_url, "operator", "operator")
    agents = [make_token(database_url, "agent", f"agent-{i:02d}") for i in range(CLAIMERS)]

    async def scenario() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=CLAIMERS * 2)
        async with httpx.AsyncClient(base_url=served, timeout=60, limits=limits) as client:
            plan = {"plan_toml": LOCAL_PLAN.read_text()}
            for _ in range(JOBS):
                assert (await client.post("/api/experiments", json=plan, headers=bearer(operator))).status_code == 201
            for i, token in enumerate(agents):
                registered = await client.post("/api/agents/register", json={"address": f"h{i}"}, headers=bearer(token))
                assert registered.status_code == 201

            async def claim_until_empty(token: str) -> list[dict[str, Any]]:
                won: list[dict[str, Any]] = []
                while True:
                    reply = await client.post("/api/agents/claim", json={"wait_seconds": 0}, headers=bearer(token))
                    assert reply.status_code == 200, reply.text
                    assignment = reply.json()["assignment"]
                    if assignment is None:
                        return won
                    won.append(assignment)

            results = await asyncio.gather(*(claim_until_empty(token) for token in agents))
            return [assignment for won in results for assignment in won]

    assignments = asyncio.run(scenario())
    job_ids = [a["job_id"] for a in assignments]
    assert len(job_ids) == JOBS and len(set(job_ids)) == JOBS
    assert len({a["lease_token"] for a in assignments}) == JOBS

    async def attempts_per_job(session: AsyncSession) -> dict[str, int]:
        from sqlalchemy import func, select

        rows = await session.execute(select(models.Attempt.job_id, func.count()).group_by(models.Attempt.job_id))
        return {str(job_id): int(n) for job_id, n in rows}

    assert set(with_session(database_url, attempts_per_job).values()) == {1}


# A waiting claim that no wakeup reaches looks again only after ten minutes; the claim's client gives up after 30
# seconds, so only a wakeup hands a waiting claim its job in time.
UNWOKEN = {"COOP_CLAIM_RECHECK_SECONDS": "600", "COOP_MAX_CLAIM_WAIT_SECONDS": "600"}


async def _claim_while_queued(claim_base: str, queue_base: str, agent: str, operator: str) -> dict[str, Any] | None:
    """An agent's claim waiting on ``claim_base`` while the operator queues a job through ``queue_base``."""
    async with httpx.AsyncClient(timeout=30) as client:
        register = f"{claim_base}/api/agents/register"
        registered = await client.post(register, json={"address": "h"}, headers=bearer(agent))
        assert registered.status_code == 201, registered.text
        claim = asyncio.create_task(
            client.post(f"{claim_base}/api/agents/claim", json={"wait_seconds": 600}, headers=bearer(agent))
        )
        await asyncio.sleep(1.0)  # the claim is waiting
        assert not claim.done()
        plan = {"plan_toml": LOCAL_PLAN.read_text()}
        created = await client.post(f"{queue_base}/api/experiments", json=plan, headers=bearer(operator))
        assert created.status_code == 201, created.text  # an experiment's first job, prepare, is queued with it
        reply = await claim  # httpx.ReadTimeout unless a wakeup reached the claim
        assert reply.status_code == 200, reply.text
        assignment: dict[str, Any] | None = reply.json()["assignment"]
        return assignment


def test_a_waiting_claim_is_woken_by_a_job_queued_while_it_waits(database_url: str, tmp_path: Path) -> None:
    empty_database(database_url)
    operator, agent = make_token(database_url, "operator", "operator"), make_token(database_url, "agent", "agent")
    with processes.served(database_url, tmp_path, **UNWOKEN) as served:
        assignment = asyncio.run(_claim_while_queued(served, served, agent, operator))
    assert assignment is not None and assignment["kind"] == "prepare"


def test_a_claim_waiting_on_one_coordinator_process_is_woken_by_a_job_queued_through_another(tmp_path: Path) -> None:
    """Two `serve` processes on one Postgres database: a job queued through one wakes a claim waiting on the
    other (LISTEN/NOTIFY)."""
    admin = database.postgres_admin_url()
    url = database.create_postgres_database(admin)
    if url is None:
        pytest.fail(f"no Postgres server answers at {admin}: run `make services` (as root)")
    try:
        migrate.upgrade(url)
        operator, agent = make_token(url, "operator", "operator"), make_token(url, "agent", "agent")
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        with (
            processes.served(url, tmp_path / "a", **UNWOKEN) as first,
            processes.served(url, tmp_path / "b", **UNWOKEN) as second,
        ):
            assignment = asyncio.run(_claim_while_queued(first, second, agent, operator))
        assert assignment is not None and assignment["kind"] == "prepare"
    finally:
        database.drop_postgres_database(admin, url)
