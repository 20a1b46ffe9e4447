"""Real agents for the agent tests (``coop-agent run``), each started and stopped by the test, against a real
coordinator (tests.support.processes.CoordinatorProcess)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

from tests.support import ROOT
from tests.support.processes import CoordinatorProcess, stop_process


class AgentProcess:
    """``python -m agent run`` with fast heartbeats and short claims, as a test needs them. Its token is in
    work_dir/agent-token (mode 0600), or in COOP_AGENT_TOKEN when ``token_from`` is "environment"; ``extra`` are more
    arguments (e.g. --ca-file); ``url`` reaches the coordinator another way than its own URL. With ``namespace`` it runs
    in that network namespace, as a host with ``address`` (tests.support.hosts)."""

    def __init__(
        self,
        coordinator: CoordinatorProcess,
        name: str,
        work_dir: Path,
        model_dir: Path,
        token: str,
        *extra: str,
        token_from: Literal["file", "environment"] = "file",
        url: str | None = None,
        namespace: str | None = None,
        address: str = "127.0.0.1",
    ) -> None:
        self.name = name
        self.work_dir = work_dir
        self.token = token
        self.token_file = work_dir / "agent-token"
        self.token_from = token_from
        self.argv = [
            *(["ip", "netns", "exec", namespace] if namespace else []),
            sys.executable,
            "-m",
            "agent",
            "run",
            "--coordinator",
            url or coordinator.url,
            *(["--token-file", str(self.token_file)] if token_from == "file" else []),
            "--name",
            name,
            "--advertise-address",
            address,
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
            *extra,
        ]
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        if self.token_from == "file":
            self.token_file.touch(mode=0o600)
            self.token_file.write_text(self.token + "\n")
        else:
            env["COOP_AGENT_TOKEN"] = self.token
        with (self.work_dir / "agent.log").open("ab") as log:
            self.process = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=log, stderr=log)

    def log(self) -> str:
        return (self.work_dir / "agent.log").read_text(errors="replace")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process is not None:
            stop_process(self.process, sig, seconds=30.0)
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
        return sum(len(json.loads(body)["events"]) for (body,) in bodies)

    def spooled_bodies(self, kind: str) -> list[dict[str, Any]]:
        """The bodies of the spooled events of ``kind`` (what the commands printed, read as the agent reads it)."""
        path = self.work_dir / "spool.sqlite3"
        if not path.exists():
            return []
        with sqlite3.connect(path, timeout=5) as db:
            if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'uploads'").fetchone():
                return []  # the agent is still making its spool
            bodies = db.execute("SELECT body FROM uploads WHERE kind = 'events'").fetchall()
        return [e["body"] for (body,) in bodies for e in json.loads(body)["events"] if e["kind"] == kind]

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
