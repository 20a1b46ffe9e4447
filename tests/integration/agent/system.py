"""The whole system as the end-to-end tests run it: a coordinator and two agents, each in a network namespace of
its own (tests.support.hosts), the agents reaching the coordinator over HTTPS (a CA the test makes) and meeting
each other on the private link; one experiment of a small plan created on it. The test reads everything back
through the coordinator's REST API."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psutil

from experiment.core import layout
from experiment.report.attempts import TrainingFault, arm_faults, read_attempts
from experiment.seed import seedmodel
from tests.conftest import LOCAL_PLAN, write_plan, write_reference_home_plan
from tests.integration.agent.support import AgentProcess
from tests.support import ROOT
from tests.support.processes import QUICK, CoordinatorProcess, coop_train
from tests.support.tls import Authority
from tests.support.waiting import wait_for

# The plan's counts: long enough (24 updates, a checkpoint every 4) for a fault to land between checkpoints of the
# pair, and a serving workload long enough (16 requests, the stop after 4) for the coordinator's stop to land midway.
COUNTS: dict[str, Any] = {
    "train": 184,
    "replay": 8,
    "updates": 24,
    "checkpoint_steps": [4, 8, 12, 16, 20, 24],
    "dev": 16,
    "workload_tasks": 16,
}


@dataclass
class System:
    server: CoordinatorProcess
    agents: dict[str, AgentProcess]
    experiment: dict[str, Any]
    topology: dict[str, Any]

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        self.server.close()

    def state(self) -> str:
        state: str = self.server.get(f"/api/experiments/{self.experiment['id']}")["state"]
        return state

    def jobs(self) -> list[dict[str, Any]]:
        return self.server.jobs(self.experiment["id"])

    def attempts(self, kind: str, arm: str | None = None) -> list[dict[str, Any]]:
        found = []
        for job in self.jobs():
            if job["kind"] == kind and (arm is None or job["arm"] == arm):
                found += self.server.get(f"/api/jobs/{job['id']}/attempts")
        return found

    def rank_steps(self, arm: str, rank: int) -> list[int]:
        """The steps every attempt of ``arm``'s rank reported, in attempt order."""
        steps: list[int] = []
        for attempt in self.attempts("train", arm):
            if attempt["rank"] == rank:
                events = self.server.get(f"/api/attempts/{attempt['id']}/events")["items"]
                steps += [e["body"]["step"] for e in events if e["kind"] == "step"]
        return steps

    def rank_steps_of(self, attempt: dict[str, Any]) -> list[int]:
        """The steps one attempt reported."""
        events = self.server.get(f"/api/attempts/{attempt['id']}/events")["items"]
        return [e["body"]["step"] for e in events if e["kind"] == "step"]

    def faults(self, arm: str, folder: Path) -> list[TrainingFault]:
        """What ``arm``'s faults cost, as the report counts them from the exported evidence bundle."""
        response = self.server.http.get(f"/api/experiments/{self.experiment['id']}/evidence.tar")
        assert response.status_code == 200, response.text
        with tarfile.open(fileobj=io.BytesIO(response.content)) as tar:
            tar.extractall(folder, filter="data")
        attempts = read_attempts(folder)
        assert attempts is not None
        results = sorted((folder / layout.arm_runs(arm)).glob("rank-*/result.json"))
        ranks = [json.loads(path.read_bytes()) for path in results]
        resumed = [rank["resumed_from_step"] for rank in ranks]
        return arm_faults(folder / layout.ATTEMPTS, arm, attempts, resumed, len(ranks[0]["journal"]), _require)

    def agent_id(self, name: str) -> str:
        agent: str = next(a["id"] for a in self.server.get("/api/agents") if a["name"] == name)
        return agent

    def host_of(self, attempt: dict[str, Any]) -> str:
        return next(name for name in self.agents if self.agent_id(name) == attempt["agent_id"])

    def resumed_from(self, attempts: list[dict[str, Any]]) -> set[int]:
        """The steps the ``attempts`` resumed from, as their ``started`` events say."""
        resumed = set()
        for attempt in attempts:
            events = self.server.get(f"/api/attempts/{attempt['id']}/events")["items"]
            (started,) = [e for e in events if e["kind"] == "started"]
            resumed.add(int(started["body"]["resumed_from_step"]))
        return resumed

    def kill_rank(self, arm: str, rank: int) -> tuple[str, str]:
        """Kill the host of ``arm``'s training rank (kill_host), wait for its gang to be lost, and bring the host back
        with its work dir (and its checkpoints); returns the train job's id and the host."""
        job = next(j for j in self.jobs() if j["kind"] == "train" and j["arm"] == arm)
        (attempt,) = [x for x in self.server.get(f"/api/jobs/{job['id']}/attempts") if x["rank"] == rank]
        host = self.host_of(attempt)
        kill_host(self.agents[host])
        wait_for(
            lambda: any(x["state"] == "lost" for x in self.server.get(f"/api/jobs/{job['id']}/attempts")),
            60,
            f"the gang of {arm} to be lost",
        )
        self.agents[host].start()
        return job["id"], host

    def kill_rank_past(self, arm: str, rank: int, step: int) -> tuple[str, str]:
        """Kill the host of ``arm``'s training rank once the rank holds its checkpoint of ``step`` (kill_rank), with
        no race against the run's end: the rank is frozen (SIGSTOP) as that checkpoint's pointer appears on its host's
        disk (the pointer, written after the checkpoint, is what a resume reads), so its peers wait at their next
        collective and none can finish before the kill. A run's reported steps arrive too late for that: a small
        model's updates take milliseconds."""
        job = wait_for(lambda: self._train_job(arm), 900, f"{arm}'s train job")

        def ranked() -> list[dict[str, Any]]:
            return [x for x in self.server.get(f"/api/jobs/{job['id']}/attempts") if x["rank"] == rank]

        (attempt,) = wait_for(ranked, 900, f"{arm}'s rank {rank} to start")
        agent = self.agents[self.host_of(attempt)]
        home = agent.work_dir / "experiments" / self.experiment["id"] / "home"
        saved = home / layout.run(arm, rank) / "pointers" / f"step-{step:06d}.json"
        wait_for(saved.exists, 900, f"{saved} to be saved", pause=0.005)
        assert agent.process is not None
        for child in psutil.Process(agent.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.suspend()
        assert not any(x["state"] == "succeeded" for x in self.server.get(f"/api/jobs/{job['id']}/attempts"))
        return self.kill_rank(arm, rank)

    def _train_job(self, arm: str) -> dict[str, Any] | None:
        return next((j for j in self.jobs() if j["kind"] == "train" and j["arm"] == arm), None)

    def model_identity(self, arm: str) -> str:
        """The arm's final parameter digest, as the coordinator recorded it."""
        arms = {a["name"]: a for a in self.server.get(f"/api/experiments/{self.experiment['id']}/arms")}
        identity: str = arms[arm]["model_identity"]
        return identity

    def uninterrupted(self, arm: str, world_size: int, seed_dir: Path, folder: Path) -> str:
        """The final parameter digest of ``arm`` trained without a fault on the experiment's prepared inputs, here
        (``world_size`` local gloo ranks): the truth a faulted run's parameters must equal, bit for bit."""
        home = folder / "home"
        prepared = self.agents["host-a"].work_dir / "experiments" / self.experiment["id"] / "home" / "prepared"
        shutil.copytree(prepared, home / "prepared")
        ranks = coop_train(home, seed_dir, arm, world_size)
        assert all(r.returncode == 0 for r in ranks), [r.stderr[-2000:] for r in ranks]
        digest: str = json.loads((home / "runs" / arm / "rank-0" / "result.json").read_text())["parameter_digest"]
        return digest

    def failure(self, failed: list[dict[str, Any]]) -> str:
        """The failed jobs with their attempts' reasons first, then the logs' tails."""
        server_log = (self.server.home / "server.log").read_text(errors="replace")
        reasons = [line for line in server_log.splitlines() if " failed: " in line]
        agents = "\n".join(f"--- {name}\n{a.log()[-3000:]}" for name, a in self.agents.items())
        jobs = [(j["kind"], j["arm"], j["id"]) for j in failed]
        attempts = [
            (a["number"], a["rank"], a["state"], (a["reason"] or "")[-1500:])
            for j in failed
            for a in self.server.get(f"/api/jobs/{j['id']}/attempts")
        ]
        return f"failed jobs {jobs}\nattempts {attempts}\ncoordinator: {reasons[-5:]}\n{agents}"

    def describe(self) -> str:
        """Where the run stands, for a wait that timed out: the experiment's state, each job with its attempts, and
        the tails of the coordinator's and the agents' logs."""
        lines = [f"experiment {self.state()}"]
        for job in self.jobs():
            attempts = self.server.get(f"/api/jobs/{job['id']}/attempts")
            ranks = ", ".join(f"#{a['number']} rank {a['rank']} {a['state']} {a['reason'] or ''}" for a in attempts)
            lines.append(f"  {job['kind']} {job['arm']} {job['role']}: {job['state']} [{ranks}]")
        logs = [("coordinator", self.server.log())] + [(name, agent.log()) for name, agent in self.agents.items()]
        for name, log in logs:
            lines += [f"--- {name}", *log.splitlines()[-25:]]
        return "\n".join(lines)

    def _jobs_unfailed(self) -> list[dict[str, Any]]:
        """The experiment's jobs; a failed one fails the caller at once, with its reasons and the logs."""
        jobs = self.jobs()
        failed = [j for j in jobs if j["state"] == "failed"]
        assert not failed, self.failure(failed)
        return jobs

    def wait_state(self, states: set[str], seconds: float) -> str:
        """Wait for the experiment to reach one of ``states``; a failed job fails the wait at once."""

        def reached() -> str | None:
            self._jobs_unfailed()
            state = self.state()
            return state if state in states else None

        return wait_for(reached, seconds, lambda: f"the experiment to become {states}\n{self.describe()}")

    def wait_job(self, kind: str, states: set[str], seconds: float) -> dict[str, Any]:
        """Wait for a job of ``kind`` to reach one of ``states``; a failed job fails the wait at once."""

        def reached() -> dict[str, Any] | None:
            return next((j for j in self._jobs_unfailed() if j["kind"] == kind and j["state"] in states), None)

        return wait_for(reached, seconds, lambda: f"a {kind} job to become {states}\n{self.describe()}")


def local_sgd_plan(path: Path, seed: seedmodel.Snapshot, ranks: int = 2) -> Path:
    """The local-SGD design on ``ranks`` ranks a gang, one on each host (its report needs no replica, so no vLLM):
    the cheapest plan that a coordinator and its agents take through prepare, two gangs' training, the dev and test
    evaluations, the selection and the report."""
    plan_file = write_plan(
        path, seed, ROOT / "plans" / "local-diloco.toml", sync_every=2, outer_learning_rate=0.7, outer_momentum=0.9
    )
    plan = msgspec.toml.decode(plan_file.read_bytes())
    for arm in plan["arms"]:
        if "ranks" in arm:
            arm["ranks"] = ranks
            arm["name"] = arm["name"].replace("-4", f"-{ranks}")
    plan["hosts"]["count"] = ranks
    path.write_bytes(msgspec.toml.encode(plan))
    return path


def kill_host(agent: AgentProcess) -> None:
    """The host vanishes: the agent and every process it started die at once (SIGKILL, no goodbye)."""
    assert agent.process is not None
    children = psutil.Process(agent.process.pid).children(recursive=True)
    agent.process.kill()
    # The agent starts each command in its own process group (never the test's own): kill those groups too.
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            group = os.getpgid(child.pid)
            if group != os.getpgid(0):
                os.killpg(group, signal.SIGKILL)
    agent.process.wait(timeout=10)
    agent.process = None


def _require(condition: bool, where: Path | str, field: str, problem: str) -> None:
    assert condition, f"{where}: {field}: {problem}"


def start(
    tmp: Path,
    seed: tuple[Path, seedmodel.Snapshot],
    topology: dict[str, Any],
    counts: dict[str, Any],
    lease_seconds: float,
    base: Path = LOCAL_PLAN,
    reference_home: Path | None = None,
    canary: list[str] | None = None,
) -> System:
    """The coordinator (leases of ``lease_seconds``, heartbeats every 0.5 s), an agent per host of the topology,
    and the experiment of ``base``'s plan with the test seed and ``counts``; with ``reference_home``, the plan reads
    its replay and retention files from there (staged with their hashes), and every agent is given that folder.
    Given a ``canary`` list, the operator's command line runs the draft's canary first (the runbook's way), puts
    its output lines in the list, and then commits the draft."""
    home = tmp / "coordinator"
    home.mkdir(parents=True)
    tls = Authority("coop test CA").issue(tmp / "tls", addresses=(topology["coordinator_address"],))
    server = CoordinatorProcess(
        home,
        certificate=tls,
        namespace=topology["coordinator_namespace"],
        address=topology["coordinator_address"],
        **QUICK,
        COOP_LEASE_SECONDS=str(lease_seconds),
        COOP_HEARTBEAT_SECONDS="0.5",
    )
    server.start()
    agents = {}
    for host in topology["hosts"]:
        name = host["name"]
        private = ["--private-interface", host["private_interface"], "--private-address", host["private_address"]]
        if reference_home is not None:
            private += ["--reference-home", str(reference_home)]
        agents[name] = AgentProcess(
            server,
            name,
            tmp / name,
            seed[0],
            server.agent_token(name),
            "--ca-file",
            str(tls.ca_file),
            *private,
            namespace=host["namespace"],
            address=host["public_address"],
        )
        agents[name].start()
    if reference_home is None:
        plan = write_plan(tmp / "plan.toml", seed[1], base, **counts)
    else:
        plan = write_reference_home_plan(tmp / "plan.toml", seed[1], reference_home, base, **counts)
    if canary is None:
        return System(server, agents, server.create_experiment(plan), topology)
    operator = [
        sys.executable,
        "-m",
        "server",
        "experiment",
        "--coordinator",
        server.url,
        "--ca-file",
        str(tls.ca_file),
    ]
    env = {**os.environ, "COOP_TOKEN": server.operator}
    ran = subprocess.run([*operator, "canary", "--plan", str(plan)], capture_output=True, text=True, env=env, cwd=ROOT)
    canary += ran.stdout.splitlines()
    assert ran.returncode == 0, ran.stdout + ran.stderr
    experiment_id = json.loads(canary[0])["experiment"]
    committed = subprocess.run([*operator, "commit", experiment_id], capture_output=True, text=True, env=env, cwd=ROOT)
    assert committed.returncode == 0, committed.stderr
    return System(server, agents, json.loads(committed.stdout), topology)
