"""Coordinator throughput against a real `coop-server serve` on SQLite and on Postgres: claims per second and
claim latency with N concurrent agents draining a queue of jobs, beside the rate of ``GET /health`` (a route that
does no work) from the same client; a public read's latency while 64 claims wait on
an empty queue (and idle); events per second ingested in batches. Prints one JSON object and writes it to
``--output``.

    .venv/bin/python bench/coordinator.py [--jobs 256] [--agents 8,32,128] [--backends sqlite,postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from server import migrate  # noqa: E402
from server.settings import sqlite_url  # noqa: E402
from tests.support import database  # noqa: E402
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
def _server(url: str, home: Path) -> Iterator[str]:
    port = _free_port()
    env = {**os.environ, "COOP_HOME": str(home), "COOP_DATABASE_URL": url, "COOP_LEASE_SECONDS": "600"}
    process = subprocess.Popen(
        [sys.executable, "-m", "server", "serve", "--port", str(port)],
        env=env,
        cwd=ROOT,
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
        yield base
    finally:
        process.terminate()
        process.wait(timeout=10)


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

        async def claimer(token: str) -> None:
            while True:
                started = time.perf_counter()
                reply = await client.post("/api/agents/claim", json={}, headers=bearer(token))
                latencies.append(time.perf_counter() - started)
                reply.raise_for_status()
                assignment = reply.json()["assignment"]
                if assignment is None:
                    return
                assignments.append((token, assignment))

        began = time.perf_counter()
        await asyncio.gather(*(claimer(token) for token in tokens))
        claim_seconds = time.perf_counter() - began
        assert len({a["job_id"] for _, a in assignments}) == len(assignments) == jobs, "a job was claimed twice"

        uploaders = assignments[:agents]

        async def upload(uploads: httpx.AsyncClient, token: str, job: dict[str, Any]) -> None:
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
                reply = await uploads.post(f"/api/attempts/{job['attempt_id']}/events", json=body, headers=headers)
                reply.raise_for_status()

        # New connections: one a claimer left idle longer than the server's keep-alive (5 s) may be closing.
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as uploads:
            began = time.perf_counter()
            await asyncio.gather(*(upload(uploads, token, job) for token, job in uploaders))
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


async def _health_rate(base: str, agents: int, requests: int) -> float:
    """``GET /health`` per second from ``agents`` concurrent senders: what this client and server answer for a
    route that does no work, the ceiling of any route's rate on this machine. A client of its own, so that no
    connection it leaves idle is reused by another phase after the server closed it (keep-alive, 5 s)."""
    left = iter(range(requests))
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=agents)) as client:

        async def sender() -> None:
            for _ in left:
                (await client.get("/health")).raise_for_status()

        began = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(agents)))
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


def run_backend(backend: str, agents: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="coop-bench-") as folder:
        home = Path(folder)
        admin = database.postgres_admin_url()
        if backend == "sqlite":
            url = sqlite_url(home / "bench.sqlite3")
        else:
            created = database.create_postgres_database(admin)
            if created is None:
                return {"skipped": f"no Postgres server answers at {admin}"}
            url = created
        try:
            migrate.upgrade(url)
            operator = database.make_token(url, "operator", "bench-operator")
            tokens = [database.make_token(url, "agent", f"bench-agent-{i:03d}") for i in range(agents)]
            with _server(url, home) as base:
                return asyncio.run(_measure(base, operator, tokens, args.jobs, args.batches, args.batch_size))
        finally:
            if backend == "postgres":
                database.drop_postgres_database(admin, url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=256)
    parser.add_argument("--agents", default="8,32,128", help="concurrent claimers, one run each")
    parser.add_argument("--batches", type=int, default=10, help="event batches per uploading agent")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "coordinator-cpu.json")
    args = parser.parse_args()
    results = {
        backend: [run_backend(backend, int(agents), args) for agents in args.agents.split(",")]
        for backend in args.backends.split(",")
    }
    text = json.dumps({"bench": "coordinator", "cpus": os.cpu_count(), "results": results}, indent=2)
    args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
