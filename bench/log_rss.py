"""The coordinator's peak resident memory while anyone downloads the largest log a 1.7B run makes, and pages through
its events.

The largest log is a training rank's: one ``step`` event an update and the resource samples taken during it, one a
second (experiment.learning.resources), for as long as the plan's deadline lets the run go (plans/reference.toml:
6 hours), plus what the command prints besides. That bounds it at about 6 x 3,600 + 128 + a few hundred events; the
bench stores EVENTS (30,000) such events through the agent's route, in the agent's batches of 500, on a real
``coop-server serve`` (SQLite), then reads its peak RSS (the kernel's VmHWM, reset through /proc/PID/clear_refs)
around three downloads of the whole log and one walk through its events' pages.

Usage: python bench/log_rss.py [--events N] [--label LABEL] [--out FILE]
(run from the repository whose coordinator is measured: its ``server`` package is the one served)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "log-rss.json"
EVENTS = 30_000
BATCH = 500  # agent.loop's batch_events


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "server", *args], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip().splitlines()[-1]


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid``, in bytes."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in {"VmRSS", "VmHWM"}:
            found[key] = int(value.split()[0]) * 1024
    return found


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM starts again from the present RSS


def _sample(resources: int, step: int) -> dict[str, Any]:
    """A resource sample event as a training rank prints it (experiment.learning.training, _LiveSamples)."""
    return {
        "event": "resources",
        "arm": "clean-single",
        "rank": 0,
        "step": step,
        "index": resources,
        "at": "2026-12-07T10:00:00.000000+00:00",
        "rss_bytes": 31_234_567_890,
        "cpu_percent": 97.5,
        "gpu_allocated_bytes": 34_822_232_576,
        "preflight_bytes": 38_522_494_976,
        "gpu_utilization_percent": 99.0,
    }


def _store(client: httpx.Client, agent: str, total: int) -> tuple[str, str]:
    """Register an agent, take the local plan's first job and send ``total`` events of it; its job and attempt."""
    headers = {"Authorization": f"Bearer {agent}"}
    client.post("/api/agents/register", json={"address": "bench.hosts.test"}, headers=headers).raise_for_status()
    claimed = client.post("/api/agents/claim", json={}, headers=headers)
    claimed.raise_for_status()
    job = claimed.json()["assignment"]
    sent, sequence = 0, 0
    while sent < total:
        count = min(BATCH, total - sent)
        events = [{"kind": "resources", "body": _sample(sent + i, 1 + (sent + i) // 170)} for i in range(count)]
        batch = {"lease_token": job["lease_token"], "sequence": sequence, "events": events}
        key = {"Idempotency-Key": f"{job['job_id']}:{job['attempt_id']}:{sequence}"}
        client.post(f"/api/attempts/{job['attempt_id']}/events", json=batch, headers=headers | key).raise_for_status()
        sent, sequence = sent + count, sequence + 1
    return job["job_id"], job["attempt_id"]


def measure(events: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        home = Path(scratch) / "home"
        env = {**os.environ, "COOP_HOME": str(home), "COOP_LEASE_SECONDS": "3600", "COOP_HEARTBEAT_SECONDS": "60"}
        env.pop("COOP_DATABASE_URL", None)
        _server("migrate", env=env)
        operator = _server("token", "create", "--role", "operator", "--name", "operator", env=env)
        agent = _server("token", "create", "--role", "agent", "--name", "bench", env=env)
        port = _free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
                for _ in range(300):
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        time.sleep(0.1)
                plan = (ROOT / "plans" / "local.toml").read_text()
                created = client.post(
                    "/api/experiments",
                    json={"plan_toml": plan, "commit": True, "autopilot": True},
                    headers={"Authorization": f"Bearer {operator}"},
                )
                created.raise_for_status()
                job, attempt = _store(client, agent, events)
                client.get("/health")
                _reset_peak(process.pid)
                before = _status(process.pid)
                started = time.perf_counter()
                sizes = []
                for _ in range(3):
                    with client.stream("GET", f"/jobs/{job}/attempts/{attempt}/log") as download:
                        download.raise_for_status()
                        sizes.append(sum(len(chunk) for chunk in download.iter_bytes()))
                seconds = (time.perf_counter() - started) / 3
                after_log = _status(process.pid)
                _reset_peak(process.pid)
                pages, largest, cursor = 0, 0, None
                while True:
                    query = "" if cursor is None else f"?after={cursor}"
                    page = client.get(f"/api/attempts/{attempt}/events{query}")
                    page.raise_for_status()
                    pages, largest = pages + 1, max(largest, len(page.content))
                    cursor = page.json()["next"]
                    if cursor is None:
                        break
                after_pages = _status(process.pid)
        finally:
            process.terminate()
            process.wait(timeout=30)
    return {
        "events": events,
        "log_bytes": sizes[0],
        "log_seconds": round(seconds, 3),
        "rss_before_bytes": before["VmRSS"],
        "peak_during_log_bytes": after_log["VmHWM"],
        "peak_rise_during_log_bytes": after_log["VmHWM"] - before["VmRSS"],
        "event_pages": pages,
        "largest_event_page_bytes": largest,
        "peak_rise_during_pages_bytes": after_pages["VmHWM"] - before["VmRSS"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=EVENTS)
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    found = measure(args.events)
    recorded = json.loads(args.out.read_text()) if args.out.exists() else {}
    recorded.setdefault("command", "python bench/log_rss.py --label LABEL")
    recorded.setdefault("runs", {})[args.label] = found
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(recorded, indent=2) + "\n")
    print(json.dumps({args.label: found}))


if __name__ == "__main__":
    main()
