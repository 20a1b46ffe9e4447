"""The serving benchmark: the plan's workload (the first dev tasks) through one or two probes at the plan's
client concurrency, health-aware round-robin routing, retries with the same request id, every attempt
recorded, and vLLM's benchmark metric names."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import msgspec

from experiment.core.canonical import write_new_json
from experiment.core.errors import CoopError
from experiment.core.plan import ServingPlan, plan_identity
from experiment.core.progress import Emit
from experiment.learning.corpus import Prepared, load_prepared
from experiment.learning.events import BenchmarkedEvent, StopReplicaEvent
from experiment.serving.probe import InferAnswer
from experiment.serving.servingrecord import (
    Attempt,
    Completion,
    Failure,
    Phase,
    PhaseResult,
    Workload,
    metrics,
)

ENDPOINTS = {"single": 1, "pair": 2, "failure": 2}
HEALTH_INTERVAL = 0.25  # seconds between health checks of every endpoint
ATTEMPT_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
NO_ENDPOINT_WAIT = 60.0  # seconds an attempt waits for some endpoint to be healthy before it fails
# Failure phase: after the stop is announced, new requests wait (at most this long) until the client sees a
# replica leave, so that the phase always serves part of its workload without it, however fast the rest goes.
STOP_WAIT = 120.0


class Router:
    """Round robin over the endpoints last known healthy; a failed one is skipped until healthy again."""

    def __init__(self, endpoints: list[str]) -> None:
        if not endpoints:
            raise ValueError("a router needs at least one endpoint")
        self.endpoints = list(endpoints)
        self.healthy = set(endpoints)
        self._turn = 0

    def pick(self, avoid: str | None = None) -> str | None:
        """The next healthy endpoint in turn, other than ``avoid`` while another is healthy; None if none is."""
        candidates = [e for e in self.endpoints if e in self.healthy]
        if len(candidates) > 1 and avoid in candidates:
            candidates.remove(avoid)
        if not candidates:
            return None
        for step in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._turn + step) % len(self.endpoints)]
            if endpoint in candidates:
                self._turn = (self.endpoints.index(endpoint) + 1) % len(self.endpoints)
                return endpoint
        return None  # unreachable: candidates are endpoints

    def mark_down(self, endpoint: str) -> bool:
        """True when this changed the endpoint's state."""
        if endpoint in self.healthy:
            self.healthy.discard(endpoint)
            return True
        return False

    def mark_up(self, endpoint: str) -> bool:
        if endpoint not in self.healthy:
            self.healthy.add(endpoint)
            return True
        return False


def _retryable(status: int | None) -> bool:
    """No answer, a server-side error or a timeout: another endpoint may answer. Other 4xx are final."""
    return status is None or status >= 500 or status in (408, 429)


class PhaseRun:
    def __init__(
        self, endpoints: list[str], token: str, serving: ServingPlan, task_ids: list[str], emit: Emit, phase: str
    ) -> None:
        self.router = Router(endpoints)
        self.headers = {"Authorization": f"Bearer {token}"}
        self.serving = serving
        self.task_ids = task_ids
        self.emit = emit
        self.phase = phase
        self.run_id = uuid.uuid4().hex[:16]
        self.attempts: list[Attempt] = []
        self.completions: list[Completion] = []
        self.failures: list[Failure] = []
        self.began = 0.0
        self.stop_after: int | None = None
        self._stop_announced = False
        self._stop_wait: asyncio.Task[None] | None = None
        self.stop_seen: float | None = None
        # The endpoint seen leaving after the stop was announced: the stopped replica, which is never routed to
        # again in this phase, even if its health check answers once more (vLLM's /health says 200 while it
        # drains, and a loaded host can miss one check).
        self.stopped: str | None = None
        self._left = asyncio.Event()
        # Per endpoint, set when it goes down: its attempts in flight are abandoned then (a cut link would hold
        # them until TCP gives up), and retried on another endpoint under the same request id.
        self._gone: dict[str, asyncio.Event] = {}

    def _now(self) -> float:
        return time.monotonic() - self.began

    async def _healthy(self, client: httpx.AsyncClient, endpoint: str) -> bool:
        try:
            reply = await client.get(f"{endpoint}/health", headers=self.headers, timeout=2.0)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    def _gone_event(self, endpoint: str) -> asyncio.Event:
        return self._gone.setdefault(endpoint, asyncio.Event())

    def _down(self, endpoint: str, reason: str) -> None:
        if self.router.mark_down(endpoint):
            self._gone_event(endpoint).set()
            self.emit({"event": "endpoint-down", "endpoint": endpoint, "reason": reason, "at": round(self._now(), 3)})
            if self._stop_announced and self.stopped is None:
                self.stopped = endpoint
                self.stop_seen = round(self._now(), 6)
                self._left.set()

    def _up(self, endpoint: str) -> None:
        if endpoint != self.stopped and self.router.mark_up(endpoint):
            self._gone[endpoint] = asyncio.Event()
            self.emit({"event": "endpoint-up", "endpoint": endpoint, "at": round(self._now(), 3)})

    async def watch_health(self, client: httpx.AsyncClient) -> None:
        while True:
            for endpoint in self.router.endpoints:
                if await self._healthy(client, endpoint):
                    self._up(endpoint)
                else:
                    self._down(endpoint, "health check failed")
            await asyncio.sleep(HEALTH_INTERVAL)

    async def _endpoint(self, avoid: str | None) -> str | None:
        deadline = time.monotonic() + NO_ENDPOINT_WAIT
        while (endpoint := self.router.pick(avoid)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return endpoint

    async def hold_for_stop(self) -> None:
        """Once the stop is announced, every worker holds its next request until a replica is seen to leave
        (bounded by STOP_WAIT); requests already sent go on, and are answered, drained or retried elsewhere."""
        if not self._stop_announced:
            return
        if self._stop_wait is None:
            self._stop_wait = asyncio.create_task(self._see_stop())
        await self._stop_wait

    async def _see_stop(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._left.wait(), STOP_WAIT)
        self.emit({"event": "stop-seen", "phase": self.phase, "at": self.stop_seen})

    async def request(self, client: httpx.AsyncClient, index: int, task_id: str) -> None:
        request_id = f"{self.run_id}-{index:04d}"
        first_start: float | None = None
        error = "no attempt made"
        avoid: str | None = None
        for attempt in range(1, self.serving.max_attempts + 1):
            started = self._now()
            first_start = started if first_start is None else first_start
            endpoint = await self._endpoint(avoid)
            if endpoint is None:
                error = f"no endpoint was healthy for {NO_ENDPOINT_WAIT:.0f} s"
                self._record(request_id, task_id, attempt, None, started, None, error, False)
                continue
            status, answer, error = await self._post(client, endpoint, request_id, task_id)
            self._record(request_id, task_id, attempt, endpoint, started, status, error, bool(answer and answer.cached))
            if answer is not None:
                self._complete(request_id, task_id, endpoint, attempt, first_start, answer)
                return
            self.emit(
                {"event": "attempt-failed", "request_id": request_id, "endpoint": endpoint, "status": status}
                | {"error": error, "attempt": attempt}
            )
            if not _retryable(status):
                break
            self._down(endpoint, f"request failed: {error}")
            avoid = endpoint
        self.failures.append(Failure(request_id=request_id, task_id=task_id, attempts=attempt, error=error))
        self._progress()

    async def _post(
        self, client: httpx.AsyncClient, endpoint: str, request_id: str, task_id: str
    ) -> tuple[int | None, InferAnswer | None, str]:
        """One attempt, abandoned as soon as its endpoint is seen to go down."""
        gone = self._gone_event(endpoint)
        sent = asyncio.create_task(self._send(client, endpoint, request_id, task_id))
        watch = asyncio.create_task(gone.wait())
        try:
            await asyncio.wait((sent, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not sent.done():
            sent.cancel()
            await asyncio.gather(sent, return_exceptions=True)
            return None, None, "abandoned in flight: the endpoint went down"
        return sent.result()

    async def _send(
        self, client: httpx.AsyncClient, endpoint: str, request_id: str, task_id: str
    ) -> tuple[int | None, InferAnswer | None, str]:
        try:
            reply = await client.post(
                f"{endpoint}/infer",
                json={"request_id": request_id, "task_id": task_id},
                headers=self.headers,
                timeout=ATTEMPT_TIMEOUT,
            )
        except httpx.HTTPError as exc:
            return None, None, f"{type(exc).__name__}: {exc}"
        if reply.status_code != 200:
            return reply.status_code, None, f"HTTP {reply.status_code}: {reply.text[:300]}"
        try:
            answer = msgspec.json.decode(reply.content, type=InferAnswer)
        except msgspec.DecodeError as exc:
            return reply.status_code, None, f"malformed answer: {exc}"
        if answer.request_id != request_id or answer.task_id != task_id:
            return reply.status_code, None, "the answer is for another request"
        return reply.status_code, answer, ""

    def _record(
        self,
        request_id: str,
        task_id: str,
        attempt: int,
        endpoint: str | None,
        started: float,
        status: int | None,
        error: str,
        cached: bool,
    ) -> None:
        self.attempts.append(
            Attempt(
                request_id=request_id,
                task_id=task_id,
                attempt=attempt,
                endpoint=endpoint,
                started=round(started, 6),
                ended=round(self._now(), 6),
                status=status,
                error=error or None,
                cached=cached,
            )
        )

    def _complete(
        self, request_id: str, task_id: str, endpoint: str, attempts: int, started: float, answer: InferAnswer
    ) -> None:
        ended = self._now()
        self.completions.append(
            Completion(
                request_id=request_id,
                task_id=task_id,
                endpoint=endpoint,
                attempts=attempts,
                started=round(started, 6),
                ended=round(ended, 6),
                e2el_ms=round((ended - started) * 1000, 3),
                model=answer.model,
                output_ids=answer.output_ids,
                output_tokens=len(answer.output_ids),
                correct=answer.check.correct,
                cached=answer.cached,
            )
        )
        self._progress()
        if self.stop_after is not None and not self._stop_announced and len(self.completions) >= self.stop_after:
            self.announce_stop()

    def announce_stop(self) -> None:
        """Ask for the replica to be stopped (the coordinator acts on this event); new requests wait for it."""
        self._stop_announced = True
        self.emit(msgspec.to_builtins(StopReplicaEvent(phase=self.phase, completed=len(self.completions))))

    def _progress(self) -> None:
        self.emit(
            {
                "event": "benchmark",
                "phase": self.phase,
                "done": len(self.completions) + len(self.failures),
                "total": len(self.task_ids),
                "completed": len(self.completions),
                "failed": len(self.failures),
                "retries": sum(1 for a in self.attempts if a.attempt > 1),
            }
        )

    async def _all_healthy(self, client: httpx.AsyncClient) -> None:
        """The phase starts with every endpoint healthy; one unreachable for a moment (a link cut and mended) is
        waited for, at most NO_ENDPOINT_WAIT."""
        deadline = time.monotonic() + NO_ENDPOINT_WAIT
        for endpoint in self.router.endpoints:
            while not await self._healthy(client, endpoint):
                if time.monotonic() > deadline:
                    raise CoopError(
                        f"endpoint {endpoint} was not healthy (GET /health) for {NO_ENDPOINT_WAIT:.0f} s; "
                        "the phase needs every endpoint at its start"
                    )
                await asyncio.sleep(HEALTH_INTERVAL)

    async def run(self) -> float:
        """Run the workload; the phase's duration in seconds."""
        limits = httpx.Limits(max_connections=4 * self.serving.concurrency + 8)
        async with httpx.AsyncClient(limits=limits) as client:
            await self._all_healthy(client)
            queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
            for index, task_id in enumerate(self.task_ids):
                queue.put_nowait((index, task_id))

            async def worker() -> None:
                while not queue.empty():
                    await self.hold_for_stop()
                    if queue.empty():
                        break
                    index, task_id = queue.get_nowait()
                    await self.request(client, index, task_id)

            self.began = time.monotonic()
            watcher = asyncio.create_task(self.watch_health(client))
            try:
                await asyncio.gather(*(worker() for _ in range(self.serving.concurrency)))
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
            return max((c.ended for c in self.completions), default=self._now())


def run_phase(
    home: Path,
    endpoints: list[str],
    phase: Phase,
    token: str,
    output: Path,
    emit: Emit,
    stop_after: int | None = None,
) -> PhaseResult:
    """``coop benchmark``: one phase; its JSON is a new file (an existing one is never overwritten)."""
    if output.exists():
        raise CoopError(f"{output} already exists; a benchmark phase is never overwritten")
    endpoints = _checked_endpoints(endpoints, phase)
    prepared = load_prepared(home)
    serving = prepared.plan.serving
    stop_after = _checked_stop_after(phase, serving, stop_after)
    task_ids = [item.id for item in prepared.task_items("dev")[: serving.workload_tasks]]
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    runner = PhaseRun(endpoints, token, serving, task_ids, emit, phase)
    runner.stop_after = stop_after
    emit(
        {"event": "benchmark-started", "phase": phase, "run_id": runner.run_id, "endpoints": endpoints}
        | {"requests": len(task_ids), "concurrency": serving.concurrency, "stop_after": stop_after}
    )
    duration = asyncio.run(runner.run())
    result = _phase_result(runner, prepared, endpoints, started_at, duration)
    write_new_json(output, msgspec.to_builtins(result))
    done = BenchmarkedEvent(phase=phase, output=str(output))
    emit(msgspec.to_builtins(done) | msgspec.to_builtins(result.metrics))
    return result


def _checked_endpoints(endpoints: list[str], phase: Phase) -> list[str]:
    """The phase's endpoints without a trailing slash: as many as it takes, distinct, each an http(s) URL."""
    endpoints = [e.rstrip("/") for e in endpoints]
    if len(endpoints) != ENDPOINTS[phase] or len(set(endpoints)) != len(endpoints):
        raise CoopError(f"the {phase} phase takes {ENDPOINTS[phase]} distinct endpoint(s), got {len(endpoints)}")
    for endpoint in endpoints:
        if not endpoint.startswith(("http://", "https://")):
            raise CoopError(f"endpoint {endpoint} is not an http(s) URL")
    return endpoints


def _checked_stop_after(phase: Phase, serving: ServingPlan, stop_after: int | None) -> int | None:
    """After how many completions the failure phase stops a replica (a quarter of the workload unless given);
    None for the other phases."""
    if phase == "failure":
        stop_after = serving.workload_tasks // 4 if stop_after is None else stop_after
        if not 1 <= stop_after < serving.workload_tasks:
            raise CoopError(f"--stop-after must be between 1 and {serving.workload_tasks - 1}")
    elif stop_after is not None:
        raise CoopError("--stop-after is for the failure phase only")
    return stop_after


def _phase_result(
    runner: PhaseRun, prepared: Prepared, endpoints: list[str], started_at: str, duration: float
) -> PhaseResult:
    """The phase's record: its attempts in the order they started, its completions and failures by request."""
    serving, task_ids = runner.serving, runner.task_ids
    attempts = sorted(runner.attempts, key=lambda a: (a.started, a.request_id, a.attempt))
    completions = sorted(runner.completions, key=lambda c: c.request_id)
    return PhaseResult(
        phase=runner.phase,
        run_id=runner.run_id,
        started_at=started_at,
        endpoints=endpoints,
        models=sorted({c.model for c in completions}),
        plan_identity=plan_identity(prepared.plan),
        prepared_identity=prepared.identity,
        workload=Workload(
            tasks=len(task_ids),
            concurrency=serving.concurrency,
            max_attempts=serving.max_attempts,
            max_new_tokens=serving.max_new_tokens,
            numerics=prepared.plan.evaluation.numerics,
            task_ids=task_ids,
        ),
        stop_after=runner.stop_after,
        stop_seen=runner.stop_seen,
        metrics=metrics(len(task_ids), attempts, completions, duration),
        attempts=attempts,
        completions=completions,
        failures=sorted(runner.failures, key=lambda f: f.request_id),
    )
