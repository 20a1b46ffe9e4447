"""Many agents claim at once from two coordinator processes on one database, against a queue of one-rank jobs and
gangs: every rank of every job is handed out exactly once, and every gang forms whole, of distinct agents, in its
first generation. The claims are real HTTP requests to real `coop-server serve` processes; what was handed out is
checked against the attempts the coordinator recorded."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from tests.support.agent import FakeAgent
from tests.support.database import empty_database
from tests.support.processes import CoordinatorProcess
from tests.support.scenarios import bearer, prepared_experiment

EXPERIMENTS = 6  # each queues two one-rank trainings and one gang of two: 24 ranks
AGENTS = 16  # half on each coordinator process


async def _drain(url: str, token: str) -> list[dict[str, Any]]:
    """Claim training ranks until none is left for this agent; what it was handed."""
    handed: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while True:
            body = {"kinds": ["train"], "claim_key": f"concurrency-{uuid.uuid4()}"}
            reply = await client.post("/api/agents/claim", json=body, headers=bearer(token))
            assert reply.status_code == 200, reply.text
            assignment = reply.json()["assignment"]
            if assignment is None:
                return handed
            handed.append(assignment)


async def _claim_at_once(claimers: list[tuple[str, str]]) -> list[list[dict[str, Any]]]:
    return list(await asyncio.gather(*(_drain(url, token) for url, token in claimers)))


def test_many_agents_claiming_at_once_get_each_rank_once_and_form_every_gang_whole(
    database_url: str, tmp_path: Path
) -> None:
    empty_database(database_url)  # on Postgres, the session's database: what earlier tests left goes
    settings = {"COOP_LEASE_SECONDS": "600", "COOP_GANG_FORM_SECONDS": "600"}
    first = CoordinatorProcess(tmp_path / "first", database_url, migrate=False, **settings)
    second = CoordinatorProcess(tmp_path / "second", database_url, migrate=False, operator=None, **settings)
    for coordinator in (first, second):
        coordinator.home.mkdir()
    try:
        first.start()
        second.start()
        preparer = FakeAgent(first.url, first.agent_token("preparer"))
        preparer.register("preparer.hosts.test")
        experiments = [prepared_experiment(first, preparer)["id"] for _ in range(EXPERIMENTS)]
        preparer.close()
        jobs = {
            job["id"]: job for experiment in experiments for job in first.jobs(experiment) if job["kind"] == "train"
        }
        assert sorted(job["world_size"] for job in jobs.values()) == [1] * 2 * EXPERIMENTS + [2] * EXPERIMENTS

        claimers = []
        for i in range(AGENTS):
            coordinator = (first, second)[i % 2]
            agent = FakeAgent(coordinator.url, coordinator.agent_token(f"claimer-{i:02d}"))
            agent.register(f"claimer-{i:02d}.hosts.test")
            agent.close()
            claimers.append((coordinator.url, agent.token))
        handed = asyncio.run(_claim_at_once(claimers))

        # What the agents were handed: each rank of each job once, every job whole.
        by_job: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
        for agent, assignments in enumerate(handed):
            for assignment in assignments:
                by_job[assignment["job_id"]].append((agent, assignment))
        assert set(by_job) == set(jobs)
        for job_id, ranks in by_job.items():
            world = jobs[job_id]["world_size"]
            assert sorted(a["rank"] for _, a in ranks) == list(range(world)), f"job {job_id}: {ranks}"
            assert {a["number"] for _, a in ranks} == {1}, f"job {job_id} was handed out in a later generation"
            assert len({agent for agent, _ in ranks}) == world, f"gang {job_id} holds one agent twice"
            if world > 1:
                assert len({(a["master_addr"], a["master_port"]) for _, a in ranks}) == 1

        # What the coordinator recorded: one attempt per rank handed out, and no other.
        for job_id in jobs:
            recorded = first.get(f"/api/jobs/{job_id}/attempts")
            assert sorted((a["id"], a["rank"]) for a in recorded) == sorted(
                (a["attempt_id"], a["rank"]) for _, a in by_job[job_id]
            )
            assert {a["state"] for a in recorded} == {"leased"}
            assert first.get(f"/api/jobs/{job_id}")["state"] == "leased"
    finally:
        first.close()
        second.close()
