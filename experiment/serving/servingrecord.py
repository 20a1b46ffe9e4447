"""What one serving benchmark phase records (``serving/PHASE.json`` of the evidence bundle): every attempt, every
completion, every lost request and the metrics over them, under vLLM's benchmark metric names. Plain records, so
that the coordinator and its pages read them without loading the benchmark's client."""

from __future__ import annotations

from typing import Literal

import msgspec

Phase = Literal["single", "pair", "failure"]
PHASES: tuple[Phase, ...] = ("single", "pair", "failure")


class Attempt(msgspec.Struct, frozen=True):
    request_id: str
    task_id: str
    attempt: int  # 1-based
    endpoint: str | None  # None: no endpoint was healthy
    started: float  # seconds since the phase started
    ended: float
    status: int | None  # the HTTP status; None when no answer came
    error: str | None
    cached: bool


class Completion(msgspec.Struct, frozen=True):
    request_id: str
    task_id: str
    endpoint: str
    attempts: int
    started: float  # the first attempt's start, seconds since the phase started
    ended: float
    e2el_ms: float  # from the first attempt's start to the answer, retries included
    model: str
    output_ids: list[int]
    output_tokens: int
    correct: bool
    cached: bool


class Failure(msgspec.Struct, frozen=True):
    """A request of the workload that got no answer from any replica: its request and task, how many attempts it
    was given, and the error of the last one."""

    request_id: str
    task_id: str
    attempts: int
    error: str


class Metrics(msgspec.Struct, frozen=True):
    requests: int
    completed: int
    failed: int  # requests lost: no attempt succeeded
    retries: int  # attempts after the first
    first_attempt_failures: int
    cache_hits: int
    correct: int
    duration: float  # seconds, first request sent to last answer
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    mean_e2el_ms: float | None
    median_e2el_ms: float | None
    p95_e2el_ms: float | None
    p99_e2el_ms: float | None


class Workload(msgspec.Struct, frozen=True):
    tasks: int
    concurrency: int
    max_attempts: int
    max_new_tokens: int
    task_ids: list[str]
    numerics: str = "float32"  # the plan's evaluation numerics, which the replicas served in (absent: float32)


class PhaseResult(msgspec.Struct, frozen=True):
    phase: str
    run_id: str
    started_at: str  # UTC, ISO 8601
    endpoints: list[str]
    models: list[str]  # every model identity that answered
    plan_identity: str
    prepared_identity: str
    workload: Workload
    stop_after: int | None  # failure phase: the completions after which a replica is to be stopped
    # failure phase: seconds since the start at which the client saw a replica leave (None: not within STOP_WAIT)
    stop_seen: float | None
    metrics: Metrics
    attempts: list[Attempt]
    completions: list[Completion]
    failures: list[Failure]


def _percentile(values: list[float], q: float) -> float | None:
    import numpy  # here: `coop --help` reads this module's phases, and needs no numpy

    return round(float(numpy.percentile(values, q)), 3) if values else None


def metrics(requests: int, attempts: list[Attempt], completions: list[Completion], duration: float) -> Metrics:
    latencies = [c.e2el_ms for c in completions]
    tokens = sum(c.output_tokens for c in completions)
    first_failures = sum(1 for a in attempts if a.attempt == 1 and a.status != 200)
    return Metrics(
        requests=requests,
        completed=len(completions),
        failed=requests - len(completions),
        retries=sum(1 for a in attempts if a.attempt > 1),
        first_attempt_failures=first_failures,
        cache_hits=sum(c.cached for c in completions),
        correct=sum(c.correct for c in completions),
        duration=round(duration, 6),
        total_output_tokens=tokens,
        request_throughput=round(len(completions) / duration, 6) if duration > 0 else 0.0,
        output_throughput=round(tokens / duration, 6) if duration > 0 else 0.0,
        mean_e2el_ms=round(sum(latencies) / len(latencies), 3) if latencies else None,
        median_e2el_ms=_percentile(latencies, 50),
        p95_e2el_ms=_percentile(latencies, 95),
        p99_e2el_ms=_percentile(latencies, 99),
    )
