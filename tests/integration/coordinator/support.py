"""Helpers for the coordinator tests: databases, tokens and an API wrapper that speaks real HTTP."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from litestar.testing import TestClient
from sqlalchemy import delete, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from server import db, models, tokens
from server.app import create_app
from server.settings import Settings

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[3]
LOCAL_PLAN = ROOT / "plans" / "local.toml"
DEFAULT_POSTGRES = "postgresql+asyncpg://coop:coop@127.0.0.1:5432/postgres"


def postgres_admin_url() -> str:
    return os.environ.get("COOP_TEST_POSTGRES_URL", DEFAULT_POSTGRES)


async def _admin(url: str, statement: str) -> None:
    engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            await connection.execute(text(statement))
    finally:
        await engine.dispose()


def create_postgres_database(admin_url: str) -> str | None:
    """A fresh, uniquely named database; None when no server answers."""
    name = f"coop_test_{uuid.uuid4().hex[:12]}"
    try:
        asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    except (OSError, SQLAlchemyError):
        return None
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def drop_postgres_database(admin_url: str, url: str) -> None:
    name = make_url(url).database
    asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def with_session(url: str, work: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run ``work`` in one committed transaction on a short-lived engine."""

    async def go() -> T:
        engine = db.create_engine(url)
        try:
            async with db.session_maker(engine)() as session, session.begin():
                return await work(session)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def empty_database(url: str) -> None:
    async def wipe(session: AsyncSession) -> None:
        for table in reversed(models.Experiment.metadata.sorted_tables):
            await session.execute(delete(table))

    with_session(url, wipe)


def make_token(url: str, role: str, name: str) -> str:
    async def create(session: AsyncSession) -> str:
        return await tokens.create(session, role, name)

    return with_session(url, create)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Api:
    """The coordinator as a client sees it, with the operator's and agents' tokens at hand."""

    def __init__(self, client: TestClient[Any], url: str, home: Path | None = None) -> None:
        self.client = client
        self.url = url
        self.home = home
        self.operator = make_token(url, "operator", "operator")
        self.agents: dict[str, str] = {}

    def agent(self, name: str, address: str | None = None) -> str:
        """A registered agent's token."""
        token = make_token(self.url, "agent", name)
        self.agents[name] = token
        response = self.client.post(
            "/api/agents/register", json={"address": address or f"{name}.hosts.test"}, headers=bearer(token)
        )
        assert response.status_code == 201, response.text
        return token

    def create_experiment(self, commit: bool = True) -> dict[str, Any]:
        response = self.client.post(
            "/api/experiments",
            json={"plan_toml": LOCAL_PLAN.read_text(), "commit": commit},
            headers=bearer(self.operator),
        )
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def claim(self, token: str, wait: float = 0.0) -> dict[str, Any] | None:
        response = self.client.post("/api/agents/claim", json={"wait_seconds": wait}, headers=bearer(token))
        assert response.status_code == 200, response.text
        assignment: dict[str, Any] | None = response.json()["assignment"]
        return assignment

    def heartbeat(self, token: str, *attempt_ids: str) -> dict[str, Any]:
        response = self.client.post(
            "/api/agents/heartbeat", json={"attempt_ids": list(attempt_ids)}, headers=bearer(token)
        )
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def finish(self, token: str, assignment: dict[str, Any], outcome: str = "succeeded", **result: Any) -> Any:
        return self.client.post(
            f"/api/attempts/{assignment['attempt_id']}/result",
            json={"lease_token": assignment["lease_token"], "outcome": outcome, "exit_code": 0, "result": result},
            headers={**bearer(token), "Idempotency-Key": f"{assignment['job_id']}:{assignment['attempt_id']}:result"},
        )

    def report(self, token: str, assignment: dict[str, Any], outcome: str = "succeeded", **fields: Any) -> Any:
        """An attempt's result with top-level fields (journal, answers, serving, evidence) besides ``result``."""
        body = {"lease_token": assignment["lease_token"], "outcome": outcome, "exit_code": 0, **fields}
        return self.client.post(
            f"/api/attempts/{assignment['attempt_id']}/result",
            json=body,
            headers={**bearer(token), "Idempotency-Key": f"{assignment['job_id']}:{assignment['attempt_id']}:result"},
        )

    def upload(self, token: str, data: bytes, job: dict[str, Any] | None = None) -> str:
        """Store a blob as the operator, or as an agent naming the attempt ``job`` whose evidence it is."""
        import hashlib

        digest = hashlib.sha256(data).hexdigest()
        query = f"?attempt={job['attempt_id']}" if job is not None else ""
        response = self.client.put(f"/api/blobs/{digest}{query}", content=data, headers=bearer(token))
        assert response.status_code in {200, 201}, response.text
        return digest

    def evaluated(self, token: str, job: dict[str, Any], answers: list[dict[str, Any]] | None = None) -> Any:
        """An evaluate job's result as the agent sends it: the answers, their answers.jsonl blob named as
        evidence, and that blob's sha256 as ``answers_sha256``."""
        answers = [answer(0, True)] if answers is None else answers
        digest = self.upload(token, answers_file(answers), job)
        path = f"evaluations/{job['role']}/{job['arm']}/answers.jsonl"
        return self.report(token, job, result={"answers_sha256": digest}, answers=answers, evidence={path: digest})

    def get(self, path: str) -> Any:
        response = self.client.get(path)
        assert response.status_code == 200, response.text
        return response.json()

    def operator_post(self, path: str, body: dict[str, Any]) -> Any:
        return self.client.post(path, json=body, headers=bearer(self.operator))


@contextmanager
def running(settings: Settings) -> Iterator[TestClient[Any]]:
    with TestClient(create_app(settings)) as client:
        yield client


def sha(label: str) -> str:
    import hashlib

    return hashlib.sha256(label.encode()).hexdigest()


FINAL_STEP = 128  # plans/local.toml: training.updates


def prepared_experiment(api: Api, a: str) -> dict[str, Any]:
    """An experiment whose prepare job agent ``a`` ran: prepared identity committed, training queued."""
    experiment = api.create_experiment()
    job = api.claim(a)
    assert job is not None and job["kind"] == "prepare"
    assert api.finish(a, job, prepared_identity=sha("prepared")).status_code == 200
    return experiment


def train_result(arm: str) -> dict[str, Any]:
    return {"step": FINAL_STEP, "model_identity": sha(arm), "receipt_sha256": sha(f"receipt {arm}"), "final": True}


def trained_experiment(api: Api, a: str, b: str) -> dict[str, Any]:
    """Prepared and all three arms trained: the singles on a and b, the pair as a gang of a (rank 0) and b."""
    experiment = prepared_experiment(api, a)
    single_a, single_b = api.claim(a), api.claim(b)
    assert single_a is not None and single_b is not None
    for token, job in ((a, single_a), (b, single_b)):
        assert api.finish(token, job, **train_result(job["arm"])).status_code == 200
    rank0, rank1 = api.claim(a), api.claim(b)
    assert rank0 is not None and rank1 is not None and rank0["arm"] == "clean-pair"
    # From here on the tests drive each phase themselves (no dev evaluations or select jobs queued).
    off = api.operator_post(f"/api/experiments/{experiment['id']}/autopilot", {"on": False})
    assert off.status_code == 200 and not off.json()["autopilot"], off.text
    for token, job in ((a, rank0), (b, rank1)):
        assert api.finish(token, job, **train_result("clean-pair")).status_code == 200
    return experiment


def selection_body() -> dict[str, Any]:
    return {
        "arms": {
            arm: {"step": FINAL_STEP, "model_identity": sha(arm)}
            for arm in ("clean-single", "damaged-single", "clean-pair")
        }
    }


def select_and_advance(api: Api, experiment_id: str) -> None:
    """Commit the selection by REST, then the operator's advance queues the four test evaluations."""
    selected = api.operator_post(f"/api/experiments/{experiment_id}/selection", selection_body())
    assert selected.status_code == 201 and selected.json()["state"] == "selected", selected.text
    advanced = api.operator_post(f"/api/experiments/{experiment_id}/advance", {})
    assert advanced.status_code == 200 and advanced.json()["action"].startswith("queued evaluate test"), advanced.text


def record_report(database_url: str, home: Path, experiment_id: str, report: dict[str, Any]) -> str:
    """Commit ``report`` as the coordinator's report job does (server.reporter), for tests of what a recorded
    report looks like; over HTTP an operator can only ask the coordinator to compute one."""
    from server import experiments

    async def record(session: AsyncSession) -> str:
        experiment = await experiments.load(session, uuid.UUID(experiment_id), lock=True)
        settings = Settings(home=home, database_url=database_url)
        return await experiments.record_report(session, settings, experiment, report)

    return with_session(database_url, record)


def answers_file(answers: list[dict[str, Any]]) -> bytes:
    """answers.jsonl as experiment.evaluation writes it: one answer per line."""
    import json

    return "".join(json.dumps(item) + "\n" for item in answers).encode()


def answer(index: int, correct: bool, family: str = "lookup", variant: int = 0) -> dict[str, Any]:
    """One answer as experiment.evaluation.Answer writes it."""
    return {
        "id": f"{index:032x}",
        "index": index,
        "family": family,
        "variant": variant,
        "input_dependent": index % 2 == 0,
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5, 2],
        "text": '{"a": 1}',
        "seconds": 0.01,
        "ended_with_eos": True,
        "hit_token_limit": False,
        "check": {
            "correct": correct,
            "valid_json_object": True,
            "reason": "correct" if correct else "wrong_schema_or_value",
        },
    }


def experiment_through_testing(api: Api) -> tuple[str, str]:
    """A tested experiment (selection committed, four test evaluations recorded) and agent a's token."""
    a, b = api.agent("a"), api.agent("b")
    experiment_id = trained_experiment(api, a, b)["id"]
    select_and_advance(api, experiment_id)
    for _ in range(4):
        # A trained arm's evaluation is pinned to the host holding its checkpoint: either agent may get one.
        token, job = next((t, j) for t in (a, b) if (j := api.claim(t)) is not None)
        assert job["kind"] == "evaluate" and job["role"] == "test"
        assert api.evaluated(token, job).status_code == 200
    assert api.get(f"/api/experiments/{experiment_id}")["state"] == "tested"
    return experiment_id, a
