"""Leases: expiry makes an attempt lost and the retry a new attempt; gangs lease their agents and end together,
and a retried gang's ranks go back to their hosts; cancel asks the agent to stop and forces it after the grace
period."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from experiment import wire
from server import db, models
from server.dispatch import queue
from server.settings import Settings
from tests.integration.coordinator.support import Api, running
from tests.support import ROOT
from tests.support.agent import FakeAgent, rejection
from tests.support.scenarios import create_experiment, prepared_experiment, sha, train_result
from tests.support.waiting import wait_for


def _short_leases(make_settings: Callable[..., Settings], **overrides: Any) -> Settings:
    return make_settings(lease_seconds=0.6, heartbeat_seconds=0.2, reap_seconds=0.1, **overrides)


def test_expired_lease_is_lost_and_retried_as_a_new_attempt(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    with running(_short_leases(make_settings, max_attempts=2)) as client:
        api = Api(client, database_url)
        a = api.agent("a")
        experiment = api.create_experiment()
        first = a.claim()
        assert first is not None and first.number == 1
        job_path = f"/api/jobs/{first.job_id}"
        wait_for(
            lambda: api.get(job_path)["state"] == "queued" and api.get(job_path)["attempts_made"] == 1,
            5,
            "the reaper to end the lease",
        )
        attempts = api.get(f"{job_path}/attempts")
        assert [(x["number"], x["state"]) for x in attempts] == [(1, "lost")]
        assert "lease expired" in attempts[0]["reason"]
        # The lost attempt's late result is refused: its lease is gone.
        late = rejection(a.finish, first, result={"prepared_identity": "0" * 64})
        assert late.status_code == 409 and late.rule == "attempt-already-ended"
        second = a.claim()
        assert second is not None and second.number == 2 and second.attempt_id != first.attempt_id
        wait_for(lambda: api.get(job_path)["state"] == "lost", 5, "the reaper to end the second lease")
        states = [(x["number"], x["state"]) for x in api.get(f"{job_path}/attempts")]
        assert states == [(1, "lost"), (2, "lost")]  # both rows kept; max_attempts=2 ends the retries
        assert api.get(f"/api/experiments/{experiment['id']}")["state"] == "committed"


def test_heartbeat_renews_the_lease(make_settings: Callable[..., Settings], database_url: str) -> None:
    # A lease many heartbeats long: a busy 2-core machine can stall one heartbeat for ~1 s (seen in CI), which a
    # 0.6 s lease does not survive; a gap the lease does not cover is a lost attempt, as designed.
    with running(make_settings(lease_seconds=2.5, heartbeat_seconds=0.25, reap_seconds=0.1)) as client:
        api = Api(client, database_url)
        a = api.agent("a")
        api.create_experiment()
        job = a.claim()
        assert job is not None
        ends = time.monotonic() + 5.5  # past two leases
        while time.monotonic() < ends:
            reply = a.heartbeat(job)
            assert reply.directives == [wire.Directive(attempt_id=job.attempt_id, action="continue")]
            time.sleep(0.25)
        assert api.get(f"/api/attempts/{job.attempt_id}")["state"] == "leased"


def _gang(api: Api, a: FakeAgent, b: FakeAgent) -> tuple[wire.Assignment, wire.Assignment]:
    prepared_experiment(api, a)
    for agent, arm in ((a, "clean-single"), (b, "damaged-single")):
        single = agent.claim()
        assert single is not None and single.arm == arm
        agent.finish(single, result=train_result(arm))
    rank0 = a.claim()
    assert rank0 is not None and rank0.arm == "clean-pair" and rank0.rank == 0
    assert a.claim() is None  # agent a cannot take the second rank of its own gang
    rank1 = b.claim()
    assert rank1 is not None
    return rank0, rank1


def _stop_directive(agent: FakeAgent, job: wire.Assignment) -> wire.Directive | None:
    """The directive of a heartbeat naming ``job``, when it says stop."""
    directive = agent.heartbeat(job).directives[0]
    return directive if directive.action == "stop" else None


def test_gang_leases_both_ranks_to_two_agents_with_one_rendezvous(api: Api) -> None:
    a, b = api.agent("a", "10.1.0.1"), api.agent("b", "10.1.0.2")
    rank0, rank1 = _gang(api, a, b)
    assert (rank0.job_id, rank0.number) == (rank1.job_id, rank1.number)
    assert (rank0.rank, rank1.rank, rank0.world_size) == (0, 1, 2)
    assert rank0.master_addr == rank1.master_addr == "10.1.0.1"
    assert rank0.master_port is not None and rank0.master_port == rank1.master_port
    assert 29500 <= rank0.master_port < 30000
    attempts = api.get(f"/api/jobs/{rank0.job_id}/attempts")
    assert len({x["agent_id"] for x in attempts}) == 2


def test_a_gang_meets_at_rank_zeros_private_address_when_its_host_has_one(api: Api) -> None:
    """Hosts with a private link register its address too; the gang's rendezvous is there, not on the public one."""
    a, b = api.agent("a", "10.1.0.1"), api.agent("b", "10.1.0.2")
    a.register("10.1.0.1", private_address="192.168.50.1")
    b.register("10.1.0.2", private_address="192.168.50.2")
    listed = {agent["name"]: agent for agent in api.get("/api/agents")}
    assert (listed["a"]["address"], listed["a"]["private_address"]) == ("10.1.0.1", "192.168.50.1")
    rank0, rank1 = _gang(api, a, b)
    assert rank0.master_addr == rank1.master_addr == "192.168.50.1"


def test_a_private_address_that_is_not_an_ip_address_is_refused(api: Api) -> None:
    a = api.agent("a", "10.1.0.1")
    refused = api.client.post(
        "/api/agents/register",
        json={"address": "10.1.0.9", "private_address": "priv0"},
        headers={"Authorization": f"Bearer {a.token}"},
    )
    assert refused.status_code == 400 and "not an IP address" in refused.text
    listed = {agent["name"]: agent for agent in api.get("/api/agents")}
    assert (listed["a"]["address"], listed["a"]["private_address"]) == ("10.1.0.1", None)  # nothing changed


def test_losing_one_rank_ends_both_attempts_and_retries_the_gang(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    with running(make_settings(lease_seconds=3.0, heartbeat_seconds=0.2, reap_seconds=0.1)) as client:
        api = Api(client, database_url)
        a, b = api.agent("a", "10.1.0.1"), api.agent("b", "10.1.0.2")
        rank0, rank1 = _gang(api, a, b)
        job_path = f"/api/jobs/{rank0.job_id}"
        # b keeps heartbeating (a lease long enough for a stalled heartbeat); a falls silent and loses its lease.
        directive = wait_for(lambda: _stop_directive(b, rank1), 12, "rank 1 to be told to stop")
        assert directive.reason is not None and "rank 0 lost" in directive.reason
        states = {(x["number"], x["rank"]): x["state"] for x in api.get(f"{job_path}/attempts")}
        assert states == {(1, 0): "lost", (1, 1): "cancelled"}
        assert api.get(job_path)["state"] == "queued"
        # Each rank resumes from its own checkpoints: the retry's rank 0 waits for rank 0's host.
        assert b.claim() is None
        retry = [a.claim(), b.claim()]
        assert [(r.number, r.rank) if r else None for r in retry] == [(2, 0), (2, 1)]
        assert retry[1] is not None and retry[1].master_addr == "10.1.0.1"  # rank 0's address


def test_gang_succeeds_only_when_both_ranks_report_the_same_final_checkpoint(api: Api) -> None:
    a, b = api.agent("a"), api.agent("b")
    rank0, rank1 = _gang(api, a, b)
    a.finish(rank0, result=train_result("clean-pair"))
    assert api.get(f"/api/jobs/{rank0.job_id}")["state"] == "leased"
    b.finish(rank1, result=train_result("clean-pair"))
    assert api.get(f"/api/jobs/{rank0.job_id}")["state"] == "succeeded"


def test_cancel_asks_the_agent_to_stop_and_forces_it_after_the_grace_period(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    with running(make_settings(lease_seconds=30, heartbeat_seconds=1, reap_seconds=0.1)) as client:
        api = Api(client, database_url)
        a = api.agent("a")
        api.create_experiment()
        job = a.claim()
        assert job is not None
        assert a.start(job).state == "running"
        cancelled = api.operator_post(f"/api/jobs/{job.job_id}/cancel", {"grace_seconds": 0.5})
        assert cancelled.status_code == 201, cancelled.text
        directive = a.heartbeat(job).directives[0]
        assert directive.action == "stop" and directive.deadline is not None
        wait_for(lambda: api.get(f"/api/jobs/{job.job_id}")["state"] == "cancelled", 5, "the grace period to end")
        attempt = api.get(f"/api/attempts/{job.attempt_id}")
        assert attempt["state"] == "cancelled" and "grace" in attempt["reason"]
        again = api.operator_post(f"/api/jobs/{job.job_id}/cancel", {"grace_seconds": 0})
        assert again.status_code == 409 and again.json()["rule"] == "job-already-finished"


def test_cancelling_a_queued_job_is_immediate(api: Api) -> None:
    experiment = api.create_experiment()
    job = api.get(f"/api/experiments/{experiment['id']}/jobs")[0]
    response = api.operator_post(f"/api/jobs/{job['id']}/cancel", {"grace_seconds": 10})
    assert response.status_code == 201 and response.json()["state"] == "cancelled"
    assert api.agent("a").claim() is None


def test_half_formed_gang_is_requeued_after_the_formation_wait_without_using_a_retry(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    settings = make_settings(lease_seconds=30, heartbeat_seconds=0.2, reap_seconds=0.1, gang_form_seconds=0.6)
    with running(settings) as client:
        api = Api(client, database_url)
        a, b = api.agent("a", "10.1.0.1"), api.agent("b", "10.1.0.2")
        prepared_experiment(api, a)
        for agent, arm in ((a, "clean-single"), (b, "damaged-single")):
            single = agent.claim()
            assert single is not None and single.arm == arm
            agent.finish(single, result=train_result(arm))
        rank0 = a.claim()
        assert rank0 is not None and rank0.arm == "clean-pair" and rank0.rank == 0
        job_path = f"/api/jobs/{rank0.job_id}"
        # a keeps its lease alive while it waits for rank 1, which nobody claims: the wait still ends.
        directive = wait_for(lambda: _stop_directive(a, rank0), 5, "rank 0 to be told to stop")
        assert directive.reason is not None and "did not form within" in directive.reason
        attempts = api.get(f"{job_path}/attempts")
        assert [(x["number"], x["rank"], x["state"]) for x in attempts] == [(1, 0, "cancelled")]
        assert "1 of 2 ranks were claimed" in attempts[0]["reason"]
        assert api.get(job_path)["state"] == "queued"
        late = rejection(a.finish, rank0, result=train_result("clean-pair"))
        assert late.status_code == 409 and late.rule == "attempt-already-ended"
        # The next generation forms, and succeeds, though max_attempts counts only lost generations.
        retry0, retry1 = a.claim(), b.claim()
        assert retry0 is not None and retry1 is not None and (retry0.number, retry1.number) == (2, 2)
        for agent, job in ((a, retry0), (b, retry1)):
            agent.finish(job, result=train_result("clean-pair"))
        assert api.get(job_path)["state"] == "succeeded"


def test_failed_attempt_is_final_and_never_retried(make_settings: Callable[..., Settings], database_url: str) -> None:
    with running(make_settings(max_attempts=3)) as client:
        api = Api(client, database_url)
        a = api.agent("a")
        api.create_experiment()
        job = a.claim()
        assert job is not None
        assert a.finish(job, outcome="failed").state == "failed"
        assert api.get(f"/api/jobs/{job.job_id}")["state"] == "failed"
        assert a.claim() is None  # no retry attempt: a non-zero exit would only fail again
        assert len(api.get(f"/api/jobs/{job.job_id}/attempts")) == 1


def test_a_retried_gang_gives_each_rank_back_to_the_host_that_held_it(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    """A DiLoCo worker resumes from its own checkpoints (its optimizer is its own): however the hosts' claims
    interleave, the retry's rank r goes to the host that held rank r."""
    with running(make_settings(lease_seconds=1.0, heartbeat_seconds=0.2, reap_seconds=0.1)) as client:
        api = Api(client, database_url)
        hosts = {name: api.agent(name, f"10.1.0.{number}") for number, name in enumerate("abcd", start=1)}
        a = hosts["a"]
        experiment = create_experiment(api, ROOT / "plans" / "local-diloco.toml", autopilot=False)
        prepare = a.take("prepare")
        a.finish(prepare, result={"prepared_identity": sha("prepared")})
        queued = api.operator_post(f"/api/experiments/{experiment['id']}/jobs", {"kind": "train", "arm": "ddp-4"})
        assert queued.status_code == 201, queued.text
        first = [agent.claim("train") for agent in hosts.values()]
        assert [job.rank if job else None for job in first] == [0, 1, 2, 3]
        job_path = f"/api/jobs/{queued.json()['id']}"
        # Every host falls silent: the generation is lost and the gang queued again.
        wait_for(lambda: api.get(job_path)["state"] == "queued", 15, "the gang to be lost and queued again")
        order = []
        for name in "dcbadcbdcd":
            claimed = hosts[name].claim("train")
            if claimed is not None:
                order.append((name, claimed.number, claimed.rank))
        assert order == [("a", 2, 0), ("b", 2, 1), ("c", 2, 2), ("d", 2, 3)]


def test_two_claims_at_one_instant_form_one_gang_rather_than_two_halves(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    """Two gangs queued and two free agents claiming at once: the second claim joins the gang the first is forming.
    The first claim's transaction is held open while the second is made, as a simultaneous one would be."""
    settings = make_settings(lease_seconds=30, heartbeat_seconds=0.2)
    pairs, ids = _two_gangs_queued(settings, database_url)

    async def race() -> tuple[wire.Assignment | None, wire.Assignment | None]:
        engine = db.create_engine(database_url)
        sessions = db.session_maker(engine)
        try:
            async with sessions() as one, sessions() as two:
                async with one.begin():
                    won = await queue.claim(one, settings, await _caller(one, ids["first"]), ["train"])
                    other = asyncio.create_task(_claim_in(two, settings, ids["second"]))
                    await asyncio.sleep(0.5)  # the second claim is made while the first has not committed
                joined = await other
            return won, joined
        finally:
            await engine.dispose()

    won, joined = asyncio.run(race())
    assert won is not None and joined is not None
    assert (won.arm, won.rank, joined.rank) == ("clean-pair", 0, 1)
    assert joined.job_id == won.job_id and joined.master_port == won.master_port
    assert len(pairs) == 2 and str(won.job_id) in pairs


def test_a_claim_joins_the_forming_gang_while_a_rank_of_it_holds_its_job_row(
    make_settings: Callable[..., Settings], database_url: str
) -> None:
    """Two gangs queued; the first agent holds rank 0 of one, and its start (which holds the job's row) is under way
    when the second agent claims. The second joins that gang: taking rank 0 of the other would leave both gangs a
    rank short until their formation wait ends."""
    settings = make_settings(lease_seconds=30, heartbeat_seconds=0.2)
    _, ids = _two_gangs_queued(settings, database_url)

    async def claims() -> tuple[wire.Assignment | None, wire.Assignment | None]:
        engine = db.create_engine(database_url)
        sessions = db.session_maker(engine)
        try:
            async with sessions() as one, sessions() as starting, sessions() as two:
                won = await _claim_in(one, settings, ids["first"])
                assert won is not None
                async with starting.begin():
                    await starting.get_one(models.Job, won.job_id, with_for_update=True)  # as a rank's start does
                    other = asyncio.create_task(_claim_in(two, settings, ids["second"]))
                    await asyncio.sleep(0.5)  # the second claim is made while the row is held
                joined = await other
            return won, joined
        finally:
            await engine.dispose()

    won, joined = asyncio.run(claims())
    assert won is not None and joined is not None
    assert (won.rank, joined.rank) == (0, 1)
    assert joined.job_id == won.job_id


def _two_gangs_queued(settings: Settings, database_url: str) -> tuple[list[str], dict[str, uuid.UUID]]:
    """Two experiments' training queued, their singles cancelled, so that two gangs stay queued; and two free agents
    registered, "first" and "second". The gangs' job ids, and the agents' ids by name."""
    with running(settings) as client:
        api = Api(client, database_url)
        a = api.agent("a")
        pairs = []
        for _ in range(2):
            experiment = prepared_experiment(api, a)
            for job in api.get(f"/api/experiments/{experiment['id']}/jobs"):
                if job["kind"] == "train" and job["world_size"] == 1:
                    assert api.operator_post(f"/api/jobs/{job['id']}/cancel", {"grace_seconds": 1}).status_code == 201
                elif job["kind"] == "train":
                    pairs.append(job["id"])
        api.agent("first"), api.agent("second")
        return pairs, {agent["name"]: uuid.UUID(agent["id"]) for agent in api.get("/api/agents")}


async def _caller(session: AsyncSession, agent_id: uuid.UUID) -> queue.Caller:
    """The agent as the guard reads it for a request."""
    row = await session.get_one(models.Agent, agent_id)
    return queue.Caller(row.id, row.address, row.private_address, row.last_seen_at)


async def _claim_in(session: AsyncSession, settings: Settings, agent_id: uuid.UUID) -> wire.Assignment | None:
    async with session.begin():
        return await queue.claim(session, settings, await _caller(session, agent_id), ["train"])
