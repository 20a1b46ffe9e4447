"""The canary gate: a GPU plan is committed only once its canary passed on every host of its gang, or with an
operator's override; the plan's commitment records which, and nothing is committed by a refusal."""

from __future__ import annotations

from typing import Any

import msgspec
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from server import models
from tests.integration.coordinator.support import Api
from tests.support.database import with_session
from tests.support.scenarios import LOCAL_PLAN, bearer

STEPS = ["prepare", "all-reduce", "ddp-update", "checkpoint", "evaluate", "replica", "replica-stop"]


def _gpu_plan() -> str:
    """The local plan as it would run on two GPU hosts: its device, backend and numerics are the reference's."""
    plan = msgspec.toml.decode(LOCAL_PLAN.read_bytes())
    plan["runtime"] |= {"device": "cuda", "backend": "nccl", "autocast": "bf16"}
    plan["evaluation"]["numerics"] = "bfloat16"
    return msgspec.toml.encode(plan).decode()


def _draft(api: Api, plan_toml: str) -> dict[str, Any]:
    response = api.operator_post("/api/experiments", {"plan_toml": plan_toml, "commit": False})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def _steps(failing: str | None = None) -> list[dict[str, Any]]:
    steps = []
    for name in STEPS:
        failed = name == failing
        steps.append(
            {"name": name, "passed": not failed, "seconds": 1.5, "figures": {"tasks": 32} if name == "replica" else {}}
            | (
                {"failure": "task t3 (dev index 3): served 'a' | evaluated 'b'", "fix": "run coop-agent doctor"}
                if failed
                else {}
            )
        )
        if failed:
            break
    return steps


def _run_canary(api: Api, experiment_id: str, failing: str | None = None) -> str:
    """Queue the draft's canary and let two fake hosts report it; its job id."""
    queued = api.operator_post(f"/api/experiments/{experiment_id}/jobs", {"kind": "canary"})
    assert queued.status_code == 201, queued.text
    job = queued.json()
    assert job["world_size"] == 2 and job["spec"]["plan_toml"]  # one rank a host of the pair, with the draft's plan
    for name, rank_fails in (("a", None), ("b", failing)):
        agent = api.agents.get(name) or api.agent(name)
        claimed = agent.take("canary")
        agent.start(claimed)
        steps = _steps(rank_fails)
        agent.finish(claimed, result={"passed": rank_fails is None, "steps": steps})
    return str(job["id"])


def test_a_gpu_plan_without_a_canary_is_refused_and_nothing_is_committed(api: Api) -> None:
    response = api.operator_post("/api/experiments", {"plan_toml": _gpu_plan()})
    assert response.status_code == 409 and response.json()["rule"] == "canary-required", response.text
    assert "no canary ran for this plan" in response.json()["detail"]
    assert "--override-canary" in response.json()["detail"]
    draft = _draft(api, _gpu_plan())
    refused = api.operator_post(f"/api/experiments/{draft['id']}/commit", {})
    assert refused.status_code == 409 and refused.json()["rule"] == "canary-required"
    assert api.get(f"/api/experiments/{draft['id']}")["state"] == "draft"
    assert api.get(f"/api/experiments/{draft['id']}/ledger") == []
    missing = api.client.get(f"/api/experiments/{draft['id']}/canary")
    assert missing.status_code == 404 and "has no canary" in missing.json()["detail"]


def test_a_passed_canary_lets_the_gpu_plan_commit_and_the_ledger_records_it(api: Api) -> None:
    draft = _draft(api, _gpu_plan())
    job_id = _run_canary(api, draft["id"])
    canary = api.get(f"/api/experiments/{draft['id']}/canary")
    assert canary["passed"] and canary["job_id"] == job_id and canary["failures"] == []
    assert {host["agent"] for host in canary["hosts"]} == {"a", "b"}
    committed = api.operator_post(f"/api/experiments/{draft['id']}/commit", {})
    assert committed.status_code == 201 and committed.json()["state"] == "committed", committed.text
    [plan] = api.get(f"/api/experiments/{draft['id']}/ledger")
    recorded = plan["body"]["canary"]
    assert recorded["job"] == job_id and recorded["passed"] is True
    assert [[step["name"] for step in host["steps"]] for host in recorded["hosts"]] == [STEPS, STEPS]
    # Once committed, no canary is taken: it tries the hosts before the commitment, never after.
    late = api.operator_post(f"/api/experiments/{draft['id']}/jobs", {"kind": "canary"})
    assert late.status_code == 409 and late.json()["rule"] == "canary-requires-draft"


def test_a_failed_canary_names_the_step_and_its_fix_and_only_a_recorded_override_commits(api: Api) -> None:
    draft = _draft(api, _gpu_plan())
    _run_canary(api, draft["id"], failing="replica")
    canary = api.get(f"/api/experiments/{draft['id']}/canary")
    assert not canary["passed"]
    [failure] = canary["failures"]
    assert (
        failure.startswith("b (rank 1) step replica: task t3 (dev index 3)") and "fix: run coop-agent doctor" in failure
    )
    refused = api.operator_post(f"/api/experiments/{draft['id']}/commit", {})
    assert refused.status_code == 409 and refused.json()["rule"] == "canary-required"
    assert "step replica" in refused.json()["detail"]
    # The web page names the failed step and its fix.
    page = api.client.get(f"/experiments/{draft['id']}", headers=bearer(api.operator)).text
    assert 'data-testid="canary"' in page and "fix: run coop-agent doctor" in page
    # An empty reason is no override.
    empty = api.operator_post(f"/api/experiments/{draft['id']}/commit", {"canary_override": ""})
    assert empty.status_code == 400, empty.text
    reason = "the replica's one differing task is a known near-tie; serving is checked again by the report"
    committed = api.operator_post(f"/api/experiments/{draft['id']}/commit", {"canary_override": reason})
    assert committed.status_code == 201, committed.text
    [plan] = api.get(f"/api/experiments/{draft['id']}/ledger")
    assert plan["body"]["canary"] == {"passed": False, "override": reason, "failures": [failure]}

    async def commits(session: AsyncSession) -> list[Any]:
        rows = await session.scalars(
            select(models.AuditLog.detail).where(models.AuditLog.action == "experiment.commit")
        )
        return list(rows)

    assert with_session(api.url, commits) == [{"canary_override": reason}]


def test_a_cpu_plan_commits_without_a_canary_and_records_none(api: Api) -> None:
    experiment = api.create_experiment()
    [plan] = api.get(f"/api/experiments/{experiment['id']}/ledger")
    assert "canary" not in plan["body"]
