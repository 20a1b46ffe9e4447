"""The coordinator's own cost per request, and its throughput, against a real `coop-server serve` on SQLite and on
Postgres.

- **Server CPU per route.** One client sends each route's requests one after another; the CPU time the server's
  process tree spent over them (psutil: user + system, aiosqlite's thread included) divided by their number, beside
  the client's wall time per request. On Postgres the database's own processes' CPU is given apart. The routes: a
  claim that hands out a one-rank job, the start of an attempt, a heartbeat naming 4 attempts, an event batch of 100,
  a prepare job's result, a blob upload of 1 MiB, ``GET /api/experiments`` and ``GET /health``.
- **Throughput.** Claims per second and claim latency with N concurrent agents draining a queue of jobs, each agent a
  client with its own open connection, beside the rate of ``GET /health`` (a route that does no work) from as many
  such senders; a public read's latency while 64 claims wait on an empty queue (and idle); events per second ingested
  in batches.

``--baseline REV`` measures the server of commit REV too (from a git worktree, with the same virtual environment and
the same client), in the same run: both servers run at once, each on a database of its own, and each route's
requests go in slices to one server and then the other, so that whatever else the machine does weighs on both alike.
The JSON also holds the per-statement floor of each database layer (``statement_floor``). Prints one JSON object and
writes it to ``--output``.

    .venv/bin/python bench/coordinator.py [--baseline REV] [--requests 200] [--agents 32] [--backends sqlite,postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import psutil
import uvloop
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiment import wire  # noqa: E402
from server.settings import sqlite_url  # noqa: E402
from tests.support import database  # noqa: E402
from tests.support.agent import FakeAgent  # noqa: E402
from tests.support.scenarios import bearer  # noqa: E402

PLAN = (ROOT / "plans" / "local.toml").read_text()
WAITING = 64  # claims long-polling an empty queue while public reads are timed
HEALTH_REQUESTS = 2048  # enough that opening the senders' connections weighs little in the rate


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def _server(url: str, home: Path, source: Path) -> Iterator[tuple[str, int]]:
    """`coop-server serve` of the code in ``source``; its address and process id."""
    port = _free_port()
    env = {**os.environ, "COOP_HOME": str(home), "COOP_DATABASE_URL": url, "COOP_LEASE_SECONDS": "600"}
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port)],
        env=env,
        cwd=source,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(f"{base}/schema/openapi.json", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield base, process.pid
    finally:
        process.terminate()
        process.wait(timeout=10)


class CpuMeter:
    """CPU seconds (user + system) spent by the server's process tree and, apart, by the database's processes (the
    Postgres backends serving ``database_name``, found by their title; none for SQLite, which runs in the server)."""

    def __init__(self, server_pid: int, database_name: str | None) -> None:
        self.server = psutil.Process(server_pid)
        self.database_name = database_name

    def _processes(self, database: bool) -> list[psutil.Process]:
        if not database:
            return [self.server, *self.server.children(recursive=True)]
        if self.database_name is None:
            return []
        found = []
        for process in psutil.process_iter(["username", "cmdline"]):
            title = " ".join(process.info["cmdline"] or [])
            if process.info["username"] == "postgres" and f" {self.database_name} " in f"{title} ":
                found.append(process)
        return found

    @staticmethod
    def _times(processes: list[psutil.Process]) -> dict[int, float]:
        times = {}
        for process in processes:
            try:
                cpu = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            times[process.pid] = cpu.user + cpu.system
        return times

    def snapshot(self) -> tuple[dict[int, float], dict[int, float]]:
        return self._times(self._processes(False)), self._times(self._processes(True))

    @staticmethod
    def spent(before: dict[int, float], after: dict[int, float]) -> float:
        return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def _step_events(count: int) -> list[wire.Event]:
    return [
        msgspec.convert({"kind": "step", "body": {"step": i, "loss": 1.0 / (i + 1)}}, wire.Event) for i in range(count)
    ]


def _step_records(first: int, count: int) -> list[wire.Event]:
    """``count`` step events as a train rank prints them (its progress and the update's step record), from update
    ``first``: each becomes a measurement row."""
    return [
        msgspec.convert(
            {
                "kind": "step",
                "body": {
                    "event": "step",
                    "arm": "clean-single",
                    "rank": 0,
                    "done": step,
                    "total": 1_000_000,
                    "step": step,
                    "positions": list(range(8 * step, 8 * step + 8)),
                    "local_positions": list(range(8)),
                    "loss": 1.0 / step,
                    "learning_rate": 1e-4,
                    "gradient_norm": 0.5,
                    "targets": 640,
                    "weighted_targets": 640,
                    "documents": 8,
                    "seconds": 0.25,
                    "written_bytes": 0,
                },
            },
            wire.Event,
        )
        for step in range(first, first + count)
    ]


ROUTES = (
    "claim",
    "start",
    "heartbeat_of_4",
    "event_batch_of_100",
    "step_batch_of_100",
    "blob_1mib",
    "result",
    "list_experiments",
    "health",
)


class RouteLoad:
    """One server's routes, driven one request at a time. Agent a claims, starts, uploads a blob for and finishes
    ``count`` prepare jobs (one per experiment); agent b holds 4 attempts, which its heartbeats name, whose first one
    its event batches go to and whose second one its step records (a measurement each). The set-up warms every route
    with a few unmeasured requests."""

    WARM = 6

    def __init__(self, base: str, meter: CpuMeter, operator: str, agent_tokens: tuple[str, str], count: int) -> None:
        self.meter = meter
        self.count = count
        self.http = httpx.Client(base_url=base, timeout=60)
        for _ in range(count + self.WARM):
            body = {"plan_toml": PLAN, "commit": True, "autopilot": True}
            self.http.post("/api/experiments", json=body, headers=bearer(operator)).raise_for_status()
        self.a, self.b = (FakeAgent(base, token) for token in agent_tokens)
        self.a.register("bench-a")
        self.b.register("bench-b")
        held = [self.b.take("prepare") for _ in range(self.WARM)]  # warms claim and start
        for i, job in enumerate(held[4:]):  # warms blob and result
            self.b.upload(os.urandom(1 << 20), job)
            self.b.finish(job, result={"prepared_identity": hashlib.sha256(b"warm %d" % i).hexdigest()})
        self.held = held[:4]
        for i in range(3):
            self.b.heartbeat(*self.held)
            self.b.events(self.held[0], i, *_step_events(100))
            self.b.events(self.held[1], count + i, *_step_records(100 * (count + i) + 1, 100))
            self.http.get("/api/experiments").raise_for_status()
            self.http.get("/health").raise_for_status()
        self.jobs: list[wire.Assignment] = []
        self.blobs = [os.urandom(1 << 20) for _ in range(count)]
        self.batch = _step_events(100)
        self.steps = [_step_records(100 * i + 1, 100) for i in range(count)]
        self.totals = {route: [0, 0.0, 0.0, 0.0] for route in ROUTES}  # requests, server s, database s, wall s

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.http.close()

    def _claim(self, i: int) -> None:
        job = self.a.claim("prepare", key=f"bench-claim-{i:08d}")  # a key per claim, as the agent sends
        assert job is not None, "the queue ran dry"
        self.jobs.append(job)

    def _call(self, route: str) -> Callable[[int], object]:
        a, b, jobs = self.a, self.b, self.jobs
        return {
            "claim": self._claim,
            "start": lambda i: a.start(jobs[i]),
            "heartbeat_of_4": lambda i: b.heartbeat(*self.held),
            "event_batch_of_100": lambda i: b.events(self.held[0], 3 + i, *self.batch),
            "step_batch_of_100": lambda i: b.events(self.held[1], i, *self.steps[i]),
            "blob_1mib": lambda i: a.upload(self.blobs[i], jobs[i]),
            "result": lambda i: a.finish(jobs[i], result={"prepared_identity": hashlib.sha256(b"%d" % i).hexdigest()}),
            "list_experiments": lambda i: self.http.get("/api/experiments").raise_for_status(),
            "health": lambda i: self.http.get("/health").raise_for_status(),
        }[route]

    def measure(self, route: str, indices: range) -> None:
        """Requests ``indices`` of ``route``, one after another, added to the route's totals."""
        call = self._call(route)
        server_before, database_before = self.meter.snapshot()
        began = time.perf_counter()
        for i in indices:
            call(i)
        wall = time.perf_counter() - began
        server_after, database_after = self.meter.snapshot()
        totals = self.totals[route]
        totals[0] += len(indices)
        totals[1] += CpuMeter.spent(server_before, server_after)
        totals[2] += CpuMeter.spent(database_before, database_after)
        totals[3] += wall

    def figures(self) -> dict[str, Any]:
        """Per request: the server's (and the database's) CPU and the client's wall time, in ms."""
        figures: dict[str, Any] = {}
        for route, (requests, server, database_, wall) in self.totals.items():
            figures[route] = {
                "requests": requests,
                "server_cpu_ms": round(1000 * server / requests, 3),
                "wall_ms": round(1000 * wall / requests, 3),
            }
            if self.meter.database_name is not None:
                figures[route]["database_cpu_ms"] = round(1000 * database_ / requests, 3)
        figures["list_experiments"]["experiments"] = self.count + self.WARM
        return figures


def server_cpu(backend: str, sources: dict[str, Path], count: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Each route's server CPU per request, for the server of each source at once, each on a new database of its
    own: the routes' requests go in ``rounds`` slices, each slice to every server in turn (the order alternating),
    so that whatever else the machine does weighs on every server alike."""
    with contextlib.ExitStack() as stack:
        loads = {}
        for label, source in sources.items():
            url, home = stack.enter_context(_fresh_database(backend, source))
            operator = database.make_token(url, "operator", "bench-operator")
            tokens = (database.make_token(url, "agent", "bench-a"), database.make_token(url, "agent", "bench-b"))
            base, pid = stack.enter_context(_server(url, home, source))
            meter = CpuMeter(pid, None if backend == "sqlite" else make_url(url).database)
            loads[label] = RouteLoad(base, meter, operator, tokens, count)
            stack.callback(loads[label].close)
        slices = [range(count * k // rounds, count * (k + 1) // rounds) for k in range(rounds)]
        for route in ROUTES:
            for k, indices in enumerate(slices):
                for label in list(loads)[:: 1 if k % 2 == 0 else -1]:
                    loads[label].measure(route, indices)
        return {label: load.figures() for label, load in loads.items()}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _measure(
    base: str, operator: str, tokens: list[str], jobs: int, batches: int, batch_size: int
) -> dict[str, Any]:
    agents = len(tokens)
    limits = httpx.Limits(max_connections=agents * 2, max_keepalive_connections=agents * 2)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        semaphore = asyncio.Semaphore(8)

        async def create() -> None:
            async with semaphore:
                reply = await client.post("/api/experiments", json={"plan_toml": PLAN}, headers=bearer(operator))
                reply.raise_for_status()

        await asyncio.gather(*(create() for _ in range(jobs)))  # one prepare job each
        for i, token in enumerate(tokens):
            reply = await client.post("/api/agents/register", json={"address": f"h{i}"}, headers=bearer(token))
            reply.raise_for_status()

        latencies: list[float] = []
        assignments: list[tuple[str, dict[str, Any]]] = []

        async def claimer(agent: httpx.AsyncClient, token: str) -> None:
            while True:
                started = time.perf_counter()
                reply = await agent.post("/api/agents/claim", json={}, headers=bearer(token))
                latencies.append(time.perf_counter() - started)
                reply.raise_for_status()
                assignment = reply.json()["assignment"]
                if assignment is None:
                    return
                assignments.append((token, assignment))

        async with _agent_clients(base, agents) as clients:
            began = time.perf_counter()
            await asyncio.gather(*(claimer(agent, token) for agent, token in zip(clients, tokens, strict=True)))
            claim_seconds = time.perf_counter() - began
        assert len({a["job_id"] for _, a in assignments}) == len(assignments) == jobs, "a job was claimed twice"

        uploaders = assignments[:agents]

        async def upload(agent: httpx.AsyncClient, token: str, job: dict[str, Any]) -> None:
            for sequence in range(batches):
                body = {
                    "lease_token": job["lease_token"],
                    "sequence": sequence,
                    "events": [{"kind": "step", "body": {"step": i, "loss": 1.0 / (i + 1)}} for i in range(batch_size)],
                }
                headers = {
                    **bearer(token),
                    "Idempotency-Key": f"{job['job_id']}:{job['attempt_id']}:{sequence}",
                }
                reply = await agent.post(f"/api/attempts/{job['attempt_id']}/events", json=body, headers=headers)
                reply.raise_for_status()

        # New connections: one a claimer left idle longer than the server's keep-alive (5 s) may be closing.
        async with _agent_clients(base, len(uploaders)) as clients:
            began = time.perf_counter()
            await asyncio.gather(*(upload(agent, *job) for agent, job in zip(clients, uploaders, strict=True)))
            event_seconds = time.perf_counter() - began
    floor = await _health_rate(base, agents, HEALTH_REQUESTS)
    reads = await _reads_while_claims_wait(base, tokens)
    events = len(uploaders) * batches * batch_size
    return {
        "agents": agents,
        "jobs": jobs,
        "claims_per_second": round(jobs / claim_seconds, 1),
        "health_per_second": round(floor, 1),
        "claim_latency_p50_ms": round(1000 * statistics.median(latencies), 2),
        "claim_latency_p99_ms": round(1000 * _percentile(latencies, 0.99), 2),
        "claim_requests": len(latencies),
        "events": events,
        "event_batch_size": batch_size,
        "events_per_second": round(events / event_seconds, 1),
        **reads,
    }


@contextlib.asynccontextmanager
async def _agent_clients(base: str, agents: int) -> AsyncIterator[list[httpx.AsyncClient]]:
    """A client for each agent, its connection opened: an agent is a process of its own, and it keeps its connection
    open (it heartbeats). One client shared by all would hand its connections out unevenly, and some agents' first
    requests would wait in the client while the others claim."""
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=base, timeout=120)) for _ in range(agents)
        ]
        await asyncio.gather(*(client.get("/health") for client in clients))
        yield clients


async def _health_rate(base: str, agents: int, requests: int) -> float:
    """``GET /health`` per second from ``agents`` concurrent senders, each a client of its own as the agents are:
    what this client and server answer for a route that does no work, the ceiling of any route's rate on this
    machine. New connections, so that none an earlier phase left idle is one the server closed (keep-alive, 5 s)."""
    left = iter(range(requests))
    async with _agent_clients(base, agents) as clients:

        async def sender(client: httpx.AsyncClient) -> None:
            for _ in left:
                (await client.get("/health")).raise_for_status()

        began = time.perf_counter()
        await asyncio.gather(*(sender(client) for client in clients))
        return requests / (time.perf_counter() - began)


async def _read_latencies(client: httpx.AsyncClient, reads: int) -> list[float]:
    latencies = []
    for _ in range(reads):
        started = time.perf_counter()
        (await client.get("/api/experiments")).raise_for_status()
        latencies.append(time.perf_counter() - started)
    return latencies


async def _reads_while_claims_wait(base: str, tokens: list[str], reads: int = 50) -> dict[str, Any]:
    """GET /api/experiments from a reader of its own, idle and while WAITING claims long-poll the drained queue."""
    limits = httpx.Limits(max_connections=WAITING + 8)
    async with (
        httpx.AsyncClient(base_url=base, timeout=60) as reader,
        httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as claimers,
    ):
        idle = await _read_latencies(reader, reads)
        waiting = [
            asyncio.create_task(
                claimers.post("/api/agents/claim", json={"wait_seconds": 10}, headers=bearer(tokens[i % len(tokens)]))
            )
            for i in range(WAITING)
        ]
        await asyncio.sleep(1.0)
        busy = await _read_latencies(reader, reads)
        await asyncio.gather(*waiting)  # each ends empty after its wait
    return {
        "read_idle_p50_ms": round(1000 * statistics.median(idle), 2),
        "read_idle_p99_ms": round(1000 * _percentile(idle, 0.99), 2),
        "waiting_claims": WAITING,
        "read_while_claims_wait_p50_ms": round(1000 * statistics.median(busy), 2),
        "read_while_claims_wait_p99_ms": round(1000 * _percentile(busy, 0.99), 2),
    }


async def _statement_floor(url: str, token_secret: str, count: int = 2000) -> dict[str, float]:
    """The CPU (this process, threads included, on uvloop as the server runs) of one statement at each layer the
    coordinator stacks on the database, in µs: the bare async driver, SQLAlchemy's async session sending raw SQL,
    an ORM select of one row by key, and the server's own token lookup (a Core select of the token and its agent);
    and an empty write transaction of the coordinator's session."""
    from sqlalchemy import bindparam, select, text

    from server import db, models
    from server.access import tokens

    engine = db.create_engine(url)
    sessions = db.session_maker(engine)
    by_digest = select(models.Token).where(models.Token.secret_sha256 == bindparam("digest"))
    digest = tokens.digest(token_secret)

    async def per_call(call: Callable[[], Awaitable[object]]) -> float:
        for _ in range(50):
            await call()
        began = time.process_time()
        for _ in range(count):
            await call()
        return round(1e6 * (time.process_time() - began) / count, 1)

    figures: dict[str, float] = {}
    try:
        if db.is_sqlite(url):
            import aiosqlite

            async with aiosqlite.connect(url.split("///", 1)[1]) as bare:

                async def driver() -> None:
                    async with bare.execute("SELECT 1") as cursor:
                        await cursor.fetchall()

                figures["driver_statement_us"] = await per_call(driver)
        else:
            import asyncpg

            bare_pg = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
            try:
                figures["driver_statement_us"] = await per_call(lambda: bare_pg.fetchval("SELECT 1"))
            finally:
                await bare_pg.close()
        async with sessions() as session:
            db.reading(session)
            async with session.begin():
                figures["sqlalchemy_raw_statement_us"] = await per_call(lambda: session.execute(text("SELECT 1")))
                figures["orm_select_by_key_us"] = await per_call(
                    lambda: session.execute(
                        by_digest, {"digest": digest}, execution_options={"populate_existing": True}
                    )
                )
                figures["token_lookup_us"] = await per_call(lambda: tokens.lookup_with_agent(session, token_secret))

        async def transaction() -> None:
            async with sessions() as session, session.begin():
                await session.connection()  # BEGIN (IMMEDIATE on SQLite) and COMMIT, with nothing between

        figures["empty_write_transaction_us"] = await per_call(transaction)
    finally:
        await engine.dispose()
    return figures


@contextmanager
def _fresh_database(backend: str, source: Path) -> Iterator[tuple[str, Path]]:
    """A new database of ``backend`` with the schema of the code in ``source``, and a home folder beside it; both
    removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="coop-bench-") as folder:
        home = Path(folder)
        admin = database.postgres_admin_url()
        url = sqlite_url(home / "bench.sqlite3") if backend == "sqlite" else database.create_postgres_database(admin)
        if url is None:
            raise SystemExit(f"no Postgres server answers at {admin}")
        try:
            environment = {**os.environ, "COOP_HOME": str(home), "COOP_DATABASE_URL": url}
            command = [sys.executable, "-m", "server", "migrate"]
            subprocess.run(command, cwd=source, env=environment, check=True, capture_output=True)
            yield url, home
        finally:
            if backend != "sqlite":
                database.drop_postgres_database(admin, url)


def throughput(backend: str, source: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The concurrent measurements of the server in ``source``, on a new database."""
    figures = []
    with _fresh_database(backend, source) as (url, home):
        operator = database.make_token(url, "operator", "bench-operator")
        for agents in args.agents.split(","):
            tokens = [database.make_token(url, "agent", f"bench-{agents}-{i:03d}") for i in range(int(agents))]
            with _server(url, home, source) as (base, _):
                figures.append(asyncio.run(_measure(base, operator, tokens, args.jobs, args.batches, args.batch_size)))
    return figures


def statement_floor(backend: str) -> dict[str, float]:
    """The per-statement floor of the database layers (this checkout's engine), on a new database."""
    with _fresh_database(backend, ROOT) as (url, _):
        token = database.make_token(url, "agent", "bench-floor")
        return uvloop.run(_statement_floor(url, token))  # uvloop, as the server runs


@contextmanager
def _checkout(revision: str) -> Iterator[Path]:
    """A detached git worktree of ``revision``, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="coop-bench-baseline-"))
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(folder), revision], cwd=ROOT, check=True, capture_output=True
    )
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, check=True)


def _sources(stack: contextlib.ExitStack, baseline: str | None) -> dict[str, Path]:
    """The code measured, by label: this checkout ("after"), and the worktree of ``baseline`` ("before") if given,
    removed when ``stack`` closes."""
    if baseline is None:
        return {"after": ROOT}
    return {"before": stack.enter_context(_checkout(baseline)), "after": ROOT}


def _commit(source: Path) -> str:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, check=True, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=source, capture_output=True, text=True
    )
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="also measure the server of this git revision, in the same run")
    parser.add_argument("--requests", type=int, default=200, help="sequential requests per route for the server CPU")
    parser.add_argument("--rounds", type=int, default=4, help="slices of each route's requests, alternating servers")
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--agents", default="32", help="concurrent claimers, one run each (comma-separated)")
    parser.add_argument("--batches", type=int, default=10, help="event batches per uploading agent")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "coordinator-cpu.json")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        sources = _sources(stack, args.baseline)
        results: dict[str, Any] = {label: {"commit": _commit(source)} for label, source in sources.items()}
        floors = {}
        for backend in args.backends.split(","):
            for label, figures in server_cpu(backend, sources, args.requests, args.rounds).items():
                results[label][backend] = {"server_cpu": figures}
            for label, source in sources.items():  # the servers one after the other
                results[label][backend]["throughput"] = throughput(backend, source, args)
            floors[backend] = statement_floor(backend)
    report = {"bench": "coordinator", "cpus": os.cpu_count(), "results": results, "statement_floor": floors}
    text = json.dumps(report, indent=2)
    args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
