"""Real `coop replica`, `coop probe` and `coop benchmark` processes for the serving tests, read event by event."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.processes import free_port
from tests.support.waiting import wait_for

VLLM_VENV = ROOT / ".venv-vllm"
TINY = ROOT / "seeds" / "tiny"


def serving_env(token: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "COOP_SERVING_TOKEN": token,
    }


class EventProcess:
    """A `coop` subprocess in its own process group whose JSON-line events are collected as they come."""

    def __init__(self, args: list[str], token: str, log: Path) -> None:
        self.args = args
        self.events: list[dict[str, Any]] = []
        self._log = log.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "experiment.cli", *args],
            cwd=ROOT,
            env=serving_env(token),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.events.append(event)

    def wait_for_event(self, name: str, seconds: float) -> dict[str, Any]:
        """The first event named ``name`` (seen before or after this call); fails on exit or timeout."""

        def seen() -> dict[str, Any] | None:
            finished = not self._reader.is_alive()  # read before the events: no event can follow it
            event = next((event for event in list(self.events) if event.get("event") == name), None)
            if event is None and finished:
                code = self.process.wait()
                raise AssertionError(f"{self.args[0]} exited ({code}) before {name!r}: {self.events}; {self._log.name}")
            return event

        return wait_for(seen, seconds, lambda: f"a {name!r} event from {self.args[0]}: {self.events}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait(self, timeout: float) -> int:
        """The exit code of a process that ends by itself."""
        code = self.process.wait(timeout=timeout)
        self._reader.join(timeout=5)
        self._log.close()
        return code

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (as an agent cancels a job); the exit code."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait()
        self._reader.join(timeout=5)
        if not self._log.closed:
            self._log.close()
        return code


@dataclass(frozen=True)
class Trained:
    """A trained checkpoint of the tiny seed and the HF dev evaluation of it (the truth its replicas must tell)."""

    home: Path
    model_dir: Path  # the checkpoint's model folder
    identity: str  # its parameter digest: the served model name
    reference: Path  # evaluations/dev/clean-single of the home


class Served:
    """One replica of the trained checkpoint and the probe in front of it."""

    def __init__(self, name: str, trained: Trained, token: str, logs: Path) -> None:
        self.name = name
        self.trained = trained
        self.home = trained.home
        self.token = token
        self.logs = logs
        self.replica: EventProcess | None = None
        self.probe: EventProcess | None = None
        self.replica_url = ""
        self.probe_url = ""

    def start_replica(self) -> None:
        port = free_port()
        self.replica_url = f"http://127.0.0.1:{port}"
        args = ["replica", "--model-dir", str(self.trained.model_dir), "--served-model-name", self.trained.identity]
        self.replica = EventProcess([*args, "--port", str(port)], self.token, self.logs / f"replica-{self.name}.log")

    def start_probe(self) -> None:
        port = free_port()
        self.probe_url = f"http://127.0.0.1:{port}"
        args = ["probe", "--home", str(self.home), "--model-dir", str(TINY), "--replica", self.replica_url]
        args += ["--expect", str(self.trained.reference), "--port", str(port)]
        self.probe = EventProcess(args, self.token, self.logs / f"probe-{self.name}.log")
        self.probe.wait_for_event("listening", 180)

    def ready(self) -> bool:
        return self.replica is not None and self.replica.alive() and self.probe is not None and self.probe.alive()

    def close(self) -> None:
        for process in (self.probe, self.replica):
            if process is not None:
                process.terminate()


# The serving tests need vLLM's venv: its absence is a failure that names the command that builds it
# (tests/conftest.py's vllm_venv fixture).
needs_vllm = pytest.mark.usefixtures("vllm_venv")


class Fleet:
    """The session's replicas (a and b) with their probes; one stopped by a test is started again on demand."""

    def __init__(self, trained: Trained, token: str, logs: Path) -> None:
        self.served = [Served(name, trained, token, logs) for name in ("a", "b")]

    def ensure(self, count: int, startup_seconds: float) -> list[Served]:
        """The first ``count`` replicas, healthy, with probes listening. Replicas that must start start together,
        so the session pays for one start-up, not one per replica."""
        needed = [s for s in self.served[:count] if not s.ready()]
        for s in needed:
            s.close()
            s.start_replica()
        for s in needed:
            assert s.replica is not None
            s.replica.wait_for_event("healthy", startup_seconds)
            s.start_probe()
        return self.served[:count]

    def close(self) -> None:
        for s in self.served:
            s.close()
