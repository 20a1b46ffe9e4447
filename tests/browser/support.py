"""What the browser tests record through a real coordinator before they look at the pages: fake agents of its
hosts (tests.support.agent), the serving phases and report sections the pages show, and a finished experiment
made of a real run's evidence (the SmolLM2-135M run committed under bench/results)."""

from __future__ import annotations

import datetime
import functools
import json
import tarfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from experiment.core.plan import load_plan
from experiment.serving.servingrecord import Attempt, Completion, PhaseResult, Workload, metrics
from server import models
from tests.support import ROOT
from tests.support.agent import FakeAgent
from tests.support.database import record_report, with_session
from tests.support.processes import CoordinatorProcess
from tests.support.scenarios import create_experiment, operate, select_and_advance, sha, train_result

T = TypeVar("T")


def off_thread(work: Callable[..., T], *args: Any) -> T:
    """Run ``work`` in a worker thread: Playwright's sync API keeps an event loop running in the test's thread,
    where the database helpers' ``asyncio.run`` refuses to start."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work, *args).result()


def host_agent(coordinator: CoordinatorProcess, name: str) -> FakeAgent:
    """A registered fake agent of the host ``name`` (its address NAME.hosts.test), with a host's labels."""
    agent = FakeAgent(coordinator.url, off_thread(coordinator.agent_token, name))
    agent.register(f"{name}.hosts.test", {"hostname": f"{name}.hosts.test", "cpu_count": "2", "gpu_count": "0"})
    return agent


def step(arm: str, done: int, loss: float) -> dict[str, Any]:
    """A ``step`` event as ``coop train`` prints it (experiment.learning.training)."""
    return {
        "event": "step",
        "arm": arm,
        "rank": 0,
        "done": done,
        "total": 128,
        "step": done,
        "loss": loss,
        "learning_rate": 1e-3,
        "gradient_norm": 1.0,
        "targets": 40,
        "weighted_targets": 320,
        "documents": 8,
        "seconds": 0.05,
    }


# Serving: benchmark phases as experiment.serving.benchmark writes them, and the report's serving section -------

ENDPOINTS = ("http://host-a.hosts.test:9100", "http://host-b.hosts.test:9100")
WAVE = 0.6  # seconds between the starts of two waves of requests (longer than any request takes here)
# How long a phase's requests take, relative to the single phase's: two replicas share the load.
PACE = {"single": 1.0, "pair": 0.55, "failure": 0.7}


def _request(
    phase: str, index: int, endpoint: str, started: float, seconds: float, attempt: int = 1
) -> tuple[Attempt, Completion]:
    tokens = 20 + index % 5
    request = Attempt(
        f"{phase}-{index:04d}", f"{index:032x}", attempt, endpoint, started, started + seconds, 200, None, False
    )
    done = Completion(
        request_id=request.request_id,
        task_id=request.task_id,
        endpoint=endpoint,
        attempts=attempt,
        started=started,
        ended=request.ended,
        e2el_ms=round(1000 * seconds, 3),
        model=sha("clean-pair"),
        output_ids=[100 + token for token in range(tokens)],
        output_tokens=tokens,
        correct=index % 4 != 3,
        cached=False,
    )
    return request, done


def phase_report(phase: str, tasks: int = 24, concurrency: int = 4, pace: float = 1.0) -> dict[str, Any]:
    """A phase's report (experiment.serving.servingrecord.PhaseResult as JSON): ``tasks`` requests in waves of
    ``concurrency``, round robin over the phase's endpoints, every request's time scaled by ``pace`` and the
    phase's PACE. The failure phase stops the second endpoint after two waves: the request it holds then fails and
    is retried on the first, which takes every later request."""
    endpoints = list(ENDPOINTS[: 1 if phase == "single" else 2])
    pace *= PACE[phase]
    stop_after = 2 * concurrency if phase == "failure" else None
    stop_seen = 2 * WAVE * pace + 0.2 if stop_after is not None else None
    attempts: list[Attempt] = []
    completions: list[Completion] = []
    for index in range(tasks):
        started = (index // concurrency) * WAVE * pace + 0.01 * (index % concurrency)
        seconds = pace * (0.3 + 0.04 * (index % 7))
        endpoint = endpoints[index % len(endpoints)]
        if stop_seen is not None and started >= stop_seen:
            endpoint = endpoints[0]
        if stop_seen is not None and index == stop_after + 1:  # held by the stopped replica when it left
            failed = Attempt(
                f"{phase}-{index:04d}",
                f"{index:032x}",
                1,
                endpoint,
                started,
                stop_seen,
                503,
                "the replica is shutting down",
                False,
            )
            retry, done = _request(phase, index, endpoints[0], stop_seen + 0.01, seconds, attempt=2)
            done = msgspec.structs.replace(done, started=started, e2el_ms=round(1000 * (retry.ended - started), 3))
            attempts += [failed, retry]
        else:
            retry, done = _request(phase, index, endpoint, started, seconds)
            attempts.append(retry)
        completions.append(done)
    duration = max(c.ended for c in completions) - min(c.started for c in completions)
    result = PhaseResult(
        phase=phase,
        run_id=sha(phase)[:16],
        started_at="2026-05-04T10:00:00+00:00",
        endpoints=endpoints,
        models=[sha("clean-pair")],
        plan_identity=sha("plan"),
        prepared_identity=sha("prepared"),
        workload=Workload(tasks, concurrency, 3, 48, [c.task_id for c in completions]),
        stop_after=stop_after,
        stop_seen=stop_seen,
        metrics=metrics(tasks, attempts, completions, duration),
        attempts=attempts,
        completions=completions,
        failures=[],
    )
    built: dict[str, Any] = msgspec.to_builtins(result)
    return built


def serving_section(reports: dict[str, dict[str, Any]], with_agreement: bool = True) -> dict[str, Any]:
    """The report's serving section (experiment.report.servingcheck.section) for these phase reports; without the
    agreement (a report may hold none)."""
    failure = reports["failure"]
    last = {
        endpoint: max(a["started"] for a in failure["attempts"] if a["endpoint"] == endpoint) for endpoint in ENDPOINTS
    }
    section: dict[str, Any] = {
        "phases": {phase: report["metrics"] for phase, report in reports.items()},
        "pair_over_single_request_throughput": reports["pair"]["metrics"]["request_throughput"]
        / reports["single"]["metrics"]["request_throughput"],
        "failure": {
            "stopped_after_completions": failure["stop_after"],
            "stop_seen_at_seconds": failure["stop_seen"],
            "requests_started_after_one_replica_left": sum(
                1 for a in failure["attempts"] if a["started"] > min(last.values())
            ),
            "first_attempt_failures": failure["metrics"]["first_attempt_failures"],
            "retries": failure["metrics"]["retries"],
            "lost": failure["metrics"]["failed"],
        },
    }
    if with_agreement:
        tasks = len(reports["single"]["completions"])
        correct = reports["single"]["metrics"]["correct"]
        section["reference"] = {
            "evaluation": "evaluations/dev/clean-pair",
            "device": "cuda",
            "tasks": tasks,
            "correct": correct,
        }
        section["agreement"] = {
            phase: {
                "tasks": tasks,
                "identical": tasks - (phase == "failure"),  # one answer's last token rounded differently on the GPU
                "same_outcome": tasks,
                "matched_tokens": 530 - 3 * (phase == "failure"),
                "expected_tokens": 530,
                "token_agreement": (530 - 3 * (phase == "failure")) / 530,
                "correct": correct,
                "expected_correct": correct,
                "first_difference": "task 0000000000000000000000000000000b (dev index 11) differs at output token 19"
                if phase == "failure"
                else None,
                "first_other_outcome": None,
            }
            for phase in reports
        }
    return section


def job_times(coordinator: CoordinatorProcess, job_id: str) -> tuple[datetime.datetime, datetime.datetime]:
    """When a job's first attempt was claimed and when the job reached its final state, as recorded."""

    async def read(session: AsyncSession) -> tuple[datetime.datetime, datetime.datetime]:
        job = uuid.UUID(job_id)
        started = await session.scalar(select(func.min(models.Attempt.created_at)).where(models.Attempt.job_id == job))
        ended = await session.scalar(
            select(func.max(models.Event.at)).where(models.Event.job_id == job, models.Event.attempt_id.is_(None))
        )
        assert started is not None and ended is not None, f"job {job_id} has not run to its end"
        return started, ended

    return off_thread(with_session, coordinator.database_url, read)


def attempts_by_host(coordinator: CoordinatorProcess, experiment_id: str) -> dict[str, int]:
    """Agent name -> how many attempts of the experiment's jobs it made, from the coordinator's API."""
    names = {agent["id"]: agent["name"] for agent in coordinator.http.get("/api/agents").json()}
    found: dict[str, int] = {}
    for job in coordinator.http.get(f"/api/experiments/{experiment_id}/jobs").json():
        for attempt in coordinator.http.get(f"/api/jobs/{job['id']}/attempts").json():
            found[names[attempt["agent_id"]]] = found.get(names[attempt["agent_id"]], 0) + 1
    return found


# A finished experiment: the SmolLM2-135M run's evidence, recorded the way its agents recorded it -------------

SMOLLM2 = ROOT / "bench" / "results" / "smollm2-135m"
SMOLLM2_PLAN = ROOT / "plans" / "smollm2-135m.toml"


@functools.cache
def smollm2_evidence() -> dict[str, bytes]:
    """The run's evidence bundle (evidence.tar.gz, what `coop report` recomputed report.json from): path -> bytes."""
    found: dict[str, bytes] = {}
    with tarfile.open(SMOLLM2 / "evidence.tar.gz") as bundle:
        for member in bundle.getmembers():
            data = bundle.extractfile(member) if member.isfile() else None
            if data is not None:
                found[member.name.removeprefix("./")] = data.read()
    return found


def smollm2_report() -> dict[str, Any]:
    """The report the run's coordinator recorded."""
    report: dict[str, Any] = json.loads((SMOLLM2 / "report.json").read_bytes())
    return report


def smollm2_lines(path: str) -> list[dict[str, Any]]:
    """A JSON-lines file of the run's evidence (answers.jsonl, a prepared role file), one object a line."""
    return [json.loads(line) for line in smollm2_evidence()[path].splitlines() if line.strip()]


def smollm2_run(arm: str, rank: int) -> dict[str, Any]:
    """One rank's training result (runs/ARM/rank-N/result.json): its step journal and resource samples."""
    run: dict[str, Any] = json.loads(smollm2_evidence()[f"runs/{arm}/rank-{rank}/result.json"])
    return run


def _trained(agent: FakeAgent, job: Any) -> None:
    run = smollm2_run(str(job.arm), job.rank)
    agent.finish(
        job, result=train_result(str(job.arm)), journal=run["journal"], resource_samples=run["resource_samples"]
    )


def finished_experiment(coordinator: CoordinatorProcess, a: FakeAgent, b: FakeAgent) -> str:
    """The SmolLM2-135M run as its coordinator recorded it, to its report; its id. The plan is committed and
    prepared on a (the prepared dev and test tasks uploaded as evidence); the singles train on a and b and the
    pair's rank 0 on a, rank 1 on b, each with its run's step journal and resource samples; the selection is
    committed; the four test evaluations send the run's answers.jsonl; serving is committed and the run's
    report.json recorded. The answers and the report are the run's own: the report's counts are theirs."""
    experiment = str(create_experiment(coordinator, SMOLLM2_PLAN, autopilot=False)["id"])
    report = smollm2_report()
    prepare = a.take("prepare")
    uploads = {
        path: a.upload(smollm2_evidence()[path], prepare) for path in ("prepared/dev.jsonl", "prepared/test.jsonl")
    }
    a.finish(prepare, result={"prepared_identity": report["prepared_identity"]}, evidence=uploads)
    operate(coordinator, f"/api/experiments/{experiment}/advance", {})
    for agent in (a, b):
        _trained(agent, agent.take("train"))
    rank0, rank1 = a.take("train"), b.take("train")
    assert (rank0.arm, rank0.rank, rank1.rank) == ("clean-pair", 0, 1), (rank0, rank1)
    _trained(a, rank0)
    _trained(b, rank1)
    select_and_advance(coordinator, experiment)
    for _ in load_plan(SMOLLM2_PLAN).arm_names():
        # A trained arm's evaluation is pinned to the host holding its checkpoint: either agent may get one.
        agent, job = next((agent, job) for agent in (a, b) if (job := agent.try_take("evaluate")) is not None)
        agent.evaluated(job, smollm2_lines(f"evaluations/test/{job.arm}/answers.jsonl"))
    operate(
        coordinator,
        f"/api/experiments/{experiment}/serving",
        {"arm": "clean-pair", "model_identity": sha("clean-pair")},
    )
    off_thread(record_report, coordinator.database_url, coordinator.home, experiment, report)
    return experiment


def recorded_answers(coordinator: CoordinatorProcess, experiment_id: str, arms: list[str]) -> dict[str, dict[str, Any]]:
    """Arm -> task id -> its recorded test answer, from the coordinator's API (an arm's test answers fit one page)."""
    found: dict[str, dict[str, Any]] = {}
    for arm in arms:
        page = coordinator.get(f"/api/experiments/{experiment_id}/answers?role=test&arm={arm}&limit=1000")
        assert len(page["items"]) == page["total"], f"{arm}'s test answers take more than one page"
        found[arm] = {item["answer"]["id"]: item["answer"] for item in page["items"]}
    return found


def attempt_events(coordinator: CoordinatorProcess, attempt_id: object) -> list[dict[str, Any]]:
    """Every event the attempt recorded, from the coordinator's API: a list, or pages followed by their cursor."""
    found = coordinator.get(f"/api/attempts/{attempt_id}/events")
    if isinstance(found, list):
        return found
    events: list[dict[str, Any]] = list(found["items"])
    while found.get("next"):
        found = coordinator.get(f"/api/attempts/{attempt_id}/events?after={found['next']}")
        events += found["items"]
    return events
