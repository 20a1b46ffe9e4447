"""Real processes for the agent tests: a coordinator (``coop-server serve`` on SQLite) and agents
(``coop-agent run``), each started and stopped by the test, with a bounded wait for every condition."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx

from server.settings import sqlite_url
from tests.integration.coordinator.support import make_token
from tests.processes import ROOT, free_port

T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], seconds: float, what: str) -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {seconds:g}s waiting for {what}"
        time.sleep(0.1)


def _stop(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM, seconds: float = 15.0) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


class Coordinator:
    """``coop-server serve`` on a fixed port and a SQLite file, so that a restart finds its state again."""

    def __init__(self, home: Path, **environment: str) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.database_url = sqlite_url(home / "coordinator.sqlite3")
        self.environment = {
            "COOP_HOME": str(home),
            "COOP_DATABASE_URL": self.database_url,
            "COOP_REAP_SECONDS": "0.2",
            "COOP_MAX_CLAIM_WAIT_SECONDS": "2",
            **environment,
        }
        self.process: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(base_url=self.url, timeout=10.0)
        self.operator = ""

    def start(self) -> None:
        log = (self.home / "server.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "server", "serve", "--port", str(self.port), "--migrate"],
            cwd=ROOT,
            env={**os.environ, **self.environment},
            stdout=log,
            stderr=log,
        )
        wait_for(self._answers, 30, "the coordinator to answer")
        if not self.operator:
            self.operator = make_token(self.database_url, "operator", "operator")

    def _answers(self) -> bool:
        assert self.process is not None and self.process.poll() is None, (self.home / "server.log").read_text()
        try:
            return self.http.get("/api/agents").status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None

    def close(self) -> None:
        self.stop()
        self.http.close()

    def agent_token(self, name: str) -> str:
        return make_token(self.database_url, "agent", name)

    def get(self, path: str) -> Any:
        response = self.http.get(path)
        assert response.status_code == 200, response.text
        return response.json()

    def create_experiment(self, plan: Path) -> dict[str, Any]:
        response = self.http.post(
            "/api/experiments",
            json={"plan_toml": plan.read_text(), "commit": True},
            headers={"Authorization": f"Bearer {self.operator}"},
        )
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def jobs(self, experiment_id: str) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = self.get(f"/api/experiments/{experiment_id}/jobs")
        return jobs


class AgentProcess:
    """``python -m agent run`` with fast heartbeats and short claims, as a test needs them."""

    def __init__(self, coordinator: Coordinator, name: str, work_dir: Path, model_dir: Path, token: str) -> None:
        self.name = name
        self.work_dir = work_dir
        self.argv = [
            sys.executable,
            "-m",
            "agent",
            "run",
            "--coordinator",
            coordinator.url,
            "--token",
            token,
            "--name",
            name,
            "--advertise-address",
            "127.0.0.1",
            "--work-dir",
            str(work_dir),
            "--model-dir",
            str(model_dir),
            "--heartbeat-seconds",
            "0.3",
            "--claim-wait-seconds",
            "1",
            "--batch-seconds",
            "0.2",
            "--grace-seconds",
            "5",
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log = (self.work_dir / "agent.log").open("ab")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=log)

    def log(self) -> str:
        return (self.work_dir / "agent.log").read_text(errors="replace")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process is not None:
            _stop(self.process, sig, seconds=30.0)
            self.process = None

    def spool(self) -> dict[str, int]:
        """Rows of the agent's spool per state (read beside the running agent: the spool is in WAL mode)."""
        path = self.work_dir / "spool.sqlite3"
        if not path.exists():
            return {}
        with sqlite3.connect(path, timeout=5) as db:
            rows = db.execute("SELECT state, COUNT(*) FROM uploads GROUP BY state").fetchall()
        return {str(state): int(count) for state, count in rows}

    def spooled_events(self) -> int:
        with sqlite3.connect(self.work_dir / "spool.sqlite3", timeout=5) as db:
            bodies = db.execute("SELECT body FROM uploads WHERE kind = 'events'").fetchall()
        import json

        return sum(len(json.loads(body)["events"]) for (body,) in bodies)

    def recorded_groups(self) -> list[int]:
        """The process groups (by leader pid) the agent has recorded in its spool as started and not yet ended."""
        path = self.work_dir / "spool.sqlite3"
        if not path.exists():
            return []
        with sqlite3.connect(path, timeout=5) as db:
            if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'process_groups'").fetchone():
                return []
            return [int(pid) for (pid,) in db.execute("SELECT pid FROM process_groups")]

    def results_spooled(self) -> int:
        path = self.work_dir / "spool.sqlite3"
        if not path.exists():
            return 0
        with sqlite3.connect(path, timeout=5) as db:
            (count,) = db.execute("SELECT COUNT(*) FROM uploads WHERE kind = 'result'").fetchone()
        return int(count)
