"""The agent against a real coordinator: it registers and heartbeats, runs a claimed job as a `coop` subprocess
and reports its events and result, keeps everything in its spool while the coordinator is down (and across its
own restart), holds its leases through heartbeats that name them, ends its command when it is killed and
reports the attempt lost when it restarts, and cannot act on another agent's lease."""

from __future__ import annotations

import contextlib
import datetime
import signal
import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from agent.client import upload_key
from experiment import wire
from experiment.seed import seedmodel
from tests.conftest import stage_reference_home, write_reference_home_plan
from tests.integration.agent.support import AgentProcess
from tests.support.agent import FakeAgent, rejection
from tests.support.processes import QUICK, CoordinatorProcess, free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


def _agent(server: CoordinatorProcess, name: str) -> dict[str, Any] | None:
    return next((a for a in server.get("/api/agents") if a["name"] == name), None)


def _prepare_job(server: CoordinatorProcess, experiment_id: str) -> dict[str, Any]:
    (job,) = [j for j in server.jobs(experiment_id) if j["kind"] == "prepare"]
    return job


def _running_train(server: CoordinatorProcess, experiment_id: str) -> dict[str, Any]:
    """A train job whose attempt runs, once the prepare job has succeeded: `coop train` takes seconds (5.5 s of the
    small plan's single arm on an idle core), where `coop prepare` ends within a second."""

    def running() -> dict[str, Any] | None:
        for job in server.jobs(experiment_id):
            attempt = _attempt(server, job["id"]) if job["kind"] == "train" else None
            if attempt is not None and attempt["state"] == "running":
                return job
        return None

    return wait_for(running, 60, "a train attempt to run")


def _forwarded(server: CoordinatorProcess, attempt_id: str) -> list[dict[str, Any]]:
    """The events the agent sent (the coordinator's own state changes carry no sequence)."""
    events = server.get(f"/api/attempts/{attempt_id}/events")["items"]
    return [e for e in events if e["sequence"] is not None]


def _attempts(server: CoordinatorProcess, job_id: str) -> list[dict[str, Any]]:
    attempts: list[dict[str, Any]] = server.get(f"/api/jobs/{job_id}/attempts")
    return attempts


def _attempt(server: CoordinatorProcess, job_id: str) -> dict[str, Any] | None:
    attempts = _attempts(server, job_id)
    return attempts[-1] if attempts else None


def _ended(attempt: dict[str, Any]) -> dict[str, Any] | None:
    return None if attempt["state"] in {"leased", "running"} else attempt


def _every_attempt(server: CoordinatorProcess, experiment_id: str, kind: str | None = None) -> list[dict[str, Any]]:
    jobs = [j for j in server.jobs(experiment_id) if kind in {None, j["kind"]}]
    return [a for j in jobs for a in _attempts(server, j["id"])]


def test_agent_registers_host_facts_and_heartbeats(
    coordinator: CoordinatorProcess, start_agent: Callable[[str], AgentProcess]
) -> None:
    start_agent("host-a")
    first = wait_for(lambda: _agent(coordinator, "host-a"), 30, "the agent to register")
    assert first["address"] == "127.0.0.1"
    assert int(first["labels"]["cpu_count"]) >= 1 and int(first["labels"]["memory_bytes"]) > 0
    seen = datetime.datetime.fromisoformat(first["last_seen_at"])
    wait_for(
        lambda: datetime.datetime.fromisoformat(_agent(coordinator, "host-a")["last_seen_at"]) > seen,  # type: ignore[index]
        10,
        "a heartbeat to renew last_seen_at",
    )


def test_agent_runs_prepare_and_its_events_and_result_arrive(
    coordinator: CoordinatorProcess, start_agent: Callable[[str], AgentProcess], small_plan: Path
) -> None:
    experiment = coordinator.create_experiment(small_plan)
    job = _prepare_job(coordinator, experiment["id"])
    agent = start_agent("host-a")
    done = wait_for(
        lambda: (j := coordinator.get(f"/api/jobs/{job['id']}"))["state"] in {"succeeded", "failed"} and j,
        90,
        "the prepare job to finish",
    )
    attempt = _attempt(coordinator, job["id"])
    assert done["state"] == "succeeded", (attempt, agent.log())
    assert attempt is not None and attempt["exit_code"] == 0
    events = _forwarded(coordinator, attempt["id"])
    (prepared,) = [e for e in events if e["kind"] == "prepared"]
    after = coordinator.get(f"/api/experiments/{experiment['id']}")
    assert after["prepared_identity"] == prepared["body"]["prepared_identity"]
    assert after["state"] == "training"  # prepared was committed and the three arms were queued
    sequences = sorted({e["sequence"] for e in events})
    assert sequences == list(range(len(sequences)))
    # Every batch, the evidence blobs (the prepared files, the seed's small files) and the result: acknowledged.
    wait_for(lambda: set(agent.spool()) == {"acknowledged"}, 10, "the spool to be acknowledged")
    evidence = {f["path"] for f in coordinator.get(f"/api/experiments/{experiment['id']}/evidence")}
    assert "prepared/manifest.json" in evidence and "seed/tokenizer.json" in evidence
    assert agent.spool()["acknowledged"] == len(sequences) + len(evidence) + 1
    assert agent.spooled_events() == len(events)


def test_a_host_without_the_plans_reference_home_fails_prepare_saying_so_and_writes_nothing(
    coordinator: CoordinatorProcess,
    start_agent: Callable[[str], AgentProcess],
    small_seed: tuple[Path, seedmodel.Snapshot],
    tmp_path: Path,
) -> None:
    plan = write_reference_home_plan(
        tmp_path / "plan.toml", small_seed[1], stage_reference_home(tmp_path / "reference-home")
    )
    experiment = coordinator.create_experiment(plan)
    job = _prepare_job(coordinator, experiment["id"])
    agent = start_agent("host-a")  # given no --reference-home
    attempt = wait_for(
        lambda: (a := _attempt(coordinator, job["id"])) is not None and _ended(a), 90, "the prepare attempt to end"
    )
    assert attempt["state"] == "failed", agent.log()
    assert "reads train-replay.jsonl and retention-probes.jsonl from a reference home" in attempt["reason"]
    assert "--reference-home" in attempt["reason"]
    assert not (agent.work_dir / "experiments" / experiment["id"] / "home").exists()
    assert coordinator.get(f"/api/experiments/{experiment['id']}")["prepared_identity"] is None


def test_spool_keeps_events_and_result_while_the_coordinator_is_down_and_across_an_agent_restart(
    coordinator: CoordinatorProcess, start_agent: Callable[[str], AgentProcess], small_plan: Path
) -> None:
    experiment = coordinator.create_experiment(small_plan)
    job = _prepare_job(coordinator, experiment["id"])
    agent = start_agent("host-a")
    wait_for(lambda: (a := _attempt(coordinator, job["id"])) and a["state"] == "running", 30, "the attempt to start")
    coordinator.stop()
    # The command goes on; its events and result wait in the spool.
    wait_for(lambda: agent.results_spooled() == 1, 90, "the result to be spooled")
    assert agent.spool().get("pending", 0) >= 1
    agent.stop(signal.SIGKILL)  # nothing may depend on a clean shutdown
    spooled = agent.spooled_events()
    agent.start()
    coordinator.start()
    done = wait_for(
        lambda: (j := coordinator.get(f"/api/jobs/{job['id']}"))["state"] in {"succeeded", "failed"} and j,
        60,
        "the spooled result to arrive",
    )
    assert done["state"] == "succeeded", agent.log()
    attempt = _attempt(coordinator, job["id"])
    assert attempt is not None
    events = _forwarded(coordinator, attempt["id"])
    assert len(events) == spooled  # every spooled event arrived, none twice
    assert [e for e in events if e["kind"] == "prepared"]
    sequences = sorted({e["sequence"] for e in events})
    assert sequences == list(range(len(sequences)))
    wait_for(lambda: set(agent.spool()) == {"acknowledged"}, 10, "the spool to be acknowledged")


def _command(agent: AgentProcess, kind: str) -> psutil.Process | None:
    """The agent's running `coop KIND` subprocess."""
    assert agent.process is not None
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(agent.process.pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if kind in child.cmdline():
                    return child
    return None


def _gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_agent_killed_while_its_command_runs_takes_the_command_with_it_and_reports_the_attempt_lost(
    coordinator: CoordinatorProcess, start_agent: Callable[[str], AgentProcess], small_plan: Path
) -> None:
    experiment = coordinator.create_experiment(small_plan)
    agent = start_agent("host-a")
    job = _running_train(coordinator, experiment["id"])
    command = wait_for(lambda: _command(agent, "train"), 30, "the agent to start `coop train`")
    wait_for(lambda: command.pid in agent.recorded_groups(), 10, "the agent to record the command's process group")
    agent.stop(signal.SIGKILL)  # the agent alone: its command is not signalled by the test
    agent.start()  # at once, on the same work dir
    wait_for(lambda: _gone(command), 10, "the killed agent's command to end")
    lost = wait_for(lambda: _ended(_attempts(coordinator, job["id"])[0]), 30, "the restarted agent's report")
    assert lost["state"] == "lost", (lost, agent.log())
    # The parent-death signal ended the command with the agent; the restart found nothing left of its group.
    assert lost["reason"] == (
        f"the agent restarted while the command ran; its command (pid {command.pid}) had ended with the agent"
    )
    assert "reporting it lost" in agent.log()
    done = wait_for(
        lambda: (j := coordinator.get(f"/api/jobs/{job['id']}"))["state"] in {"succeeded", "failed"} and j,
        90,
        "the retry to finish",
    )
    assert done["state"] == "succeeded", agent.log()
    attempts = _attempts(coordinator, job["id"])
    assert [(a["number"], a["state"]) for a in attempts] == [(1, "lost"), (2, "succeeded")]
    wait_for(lambda: set(agent.spool()) == {"acknowledged"}, 10, "the spool to be acknowledged")


def test_heartbeats_hold_the_leases_of_the_attempts_the_agent_runs_beyond_a_short_lease(
    tmp_path: Path, small_seed: tuple[Path, seedmodel.Snapshot], small_plan: Path
) -> None:
    home = tmp_path / "coordinator"
    home.mkdir()
    server = CoordinatorProcess(home, **QUICK, COOP_LEASE_SECONDS="3", COOP_HEARTBEAT_SECONDS="0.5")
    server.start()
    agent = AgentProcess(server, "host-a", tmp_path / "host-a", small_seed[0], server.agent_token("host-a"))
    try:
        experiment = server.create_experiment(small_plan)
        agent.start()
        job = _running_train(server, experiment["id"])
        done = wait_for(
            lambda: (j := server.get(f"/api/jobs/{job['id']}"))["state"] in {"succeeded", "failed", "lost"} and j,
            90,
            "the train job to finish",
        )
        assert done["state"] == "succeeded", agent.log()
        (attempt,) = _attempts(server, job["id"])
        times = [
            datetime.datetime.fromisoformat(e["at"])
            for e in server.get(f"/api/attempts/{attempt['id']}/events")["items"]
        ]
        assert (max(times) - min(times)).total_seconds() > 3.0  # it outlived its lease: heartbeats renewed it
        assert all(a["state"] != "lost" for a in _every_attempt(server, experiment["id"])), agent.log()
    finally:
        agent.stop()
        server.close()


def test_cancel_stops_the_command_and_reports_it_cancelled(
    coordinator: CoordinatorProcess, start_agent: Callable[[str], AgentProcess], small_plan: Path
) -> None:
    experiment = coordinator.create_experiment(small_plan)
    agent = start_agent("host-a")
    job = _running_train(coordinator, experiment["id"])
    response = coordinator.http.post(
        f"/api/jobs/{job['id']}/cancel",
        json={"grace_seconds": 20},
        headers={"Authorization": f"Bearer {coordinator.operator}"},
    )
    assert response.status_code == 201, response.text
    attempt = wait_for(
        lambda: (a := _attempt(coordinator, job["id"])) and a["state"] == "cancelled" and a,
        20,
        "the agent to stop the command",
    )
    assert attempt["exit_code"] == -signal.SIGTERM, agent.log()  # TERM was enough; KILL waits for the grace
    assert "cancelled by the operator" in attempt["reason"]
    assert coordinator.get(f"/api/jobs/{job['id']}")["state"] == "cancelled"


def test_an_agent_stopped_on_its_host_reports_its_attempt_lost_and_the_job_runs_again(
    coordinator: CoordinatorProcess, start_agent: Callable[[str], AgentProcess], small_plan: Path
) -> None:
    """systemd stops the agent's unit with TERM (`systemctl restart coop-agent`, a power-off): the agent stops its
    command and reports the attempt lost, not cancelled, so the job is retried (on a booted host the single then
    resumes from its checkpoint: scripts/rehearse.py); only a stop the coordinator asks for cancels a job."""
    experiment = coordinator.create_experiment(small_plan)
    agent = start_agent("host-a")
    job = _running_train(coordinator, experiment["id"])
    wait_for(lambda: _command(agent, "train"), 30, "the agent to start `coop train`")
    agent.stop(signal.SIGTERM)
    attempt = _attempt(coordinator, job["id"])
    assert attempt is not None and attempt["state"] == "lost", agent.log()
    assert attempt["exit_code"] == -signal.SIGTERM and "the agent is shutting down" in attempt["reason"]
    assert coordinator.get(f"/api/jobs/{job['id']}")["state"] == "queued"
    agent.start()  # the unit started again: the same host, work folder and spool
    done = wait_for(
        lambda: (j := coordinator.get(f"/api/jobs/{job['id']}")) and j["state"] == "succeeded" and j,
        120,
        "the job to run again and succeed",
    )
    assert done["attempts_made"] == 2, agent.log()


def test_an_agent_token_cannot_start_or_write_another_agents_attempt(
    coordinator: CoordinatorProcess, small_plan: Path
) -> None:
    a = FakeAgent(coordinator.url, coordinator.agent_token("a"))
    b = FakeAgent(coordinator.url, coordinator.agent_token("b"))
    try:
        a.register("10.0.0.1")
        b.register("10.0.0.2")
        coordinator.create_experiment(small_plan)
        job = a.claim(wait=1)
        assert job is not None
        # b sends a's lease token for a's attempt under its own agent token.
        writes: list[Callable[[], object]] = [
            lambda: b.start(job),
            lambda: b.events(job, 0, wire.Event(kind="intruder")),
            lambda: b.finish(job, "failed", reason="not mine"),
        ]
        for write in writes:
            assert rejection(write).status_code == 403
        # A wrong lease token is refused to the owner too, and the owner's real lease still works.
        assert rejection(a.start, msgspec.structs.replace(job, lease_token="x" * 32)).status_code == 403
        assert a.start(job).state == "running"
        assert _forwarded(coordinator, str(job.attempt_id)) == []
    finally:
        a.close()
        b.close()


def test_upload_keys_name_job_attempt_and_sequence() -> None:
    job, attempt = uuid.uuid4(), uuid.uuid4()
    assert upload_key(job, attempt, 3) == f"{job}:{attempt}:3"


def _two_free_ports() -> int:
    """A port P such that P and P + 1 are free on loopback now."""
    for _ in range(50):
        base = free_port()
        if base < 65535:
            with contextlib.suppress(OSError), socket.socket() as probe:
                probe.bind(("127.0.0.1", base + 1))
                return base
    raise AssertionError("no two adjacent free ports")


def test_a_gang_whose_rendezvous_port_is_taken_is_requeued_and_trains_on_the_next(
    tmp_path: Path, small_seed: tuple[Path, seedmodel.Snapshot], small_plan: Path
) -> None:
    base = _two_free_ports()
    home = tmp_path / "coordinator"
    home.mkdir()
    span = {"COOP_RENDEZVOUS_PORT_BASE": str(base), "COOP_RENDEZVOUS_PORT_SPAN": "2"}
    server = CoordinatorProcess(home, **QUICK, **span)
    server.start()
    agents = [
        AgentProcess(server, name, tmp_path / name, small_seed[0], server.agent_token(name))
        for name in ("host-a", "host-b")
    ]
    taken = socket.socket()
    try:
        experiment = server.create_experiment(small_plan)
        agents[0].start()
        pair = wait_for(
            lambda: next((j for j in server.jobs(experiment["id"]) if j["arm"] == "clean-pair"), None),
            120,
            "the pair's job to be queued",
        )
        # Something else listens on the port of the gang's first attempt (the coordinator's choice, per job and
        # attempt); only then can the gang form.
        first_port = base + (uuid.UUID(pair["id"]).int + 1) % 2
        taken.bind(("127.0.0.1", first_port))
        taken.listen()
        agents[1].start()
        done = wait_for(
            lambda: (j := server.get(f"/api/jobs/{pair['id']}"))["state"] in {"succeeded", "failed"} and j,
            300,
            "the pair to train",
        )
        attempts = _attempts(server, pair["id"])
        assert done["state"] == "succeeded", (attempts, [a.log()[-3000:] for a in agents])
        first = {a["rank"]: a for a in attempts if a["number"] == 1}
        # Rank 0 could not listen: its attempt ended lost (not failed), its peer with it, and the gang was requeued.
        assert first[0]["state"] == "lost" and "address already in use" in first[0]["reason"], first[0]
        assert first[0]["master_port"] == first_port and first[1]["state"] in {"lost", "cancelled"}
        second = [a for a in attempts if a["number"] == 2]
        assert sorted((a["rank"], a["state"]) for a in second) == [(0, "succeeded"), (1, "succeeded")]
        assert {a["master_port"] for a in second} == {base + base + 1 - first_port}
    finally:
        taken.close()
        for agent in agents:
            agent.stop()
        server.close()
