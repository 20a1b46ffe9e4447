"""Real processes: a coordinator (`coop-server serve`), and ranks with the torchrun environment for the training
and evaluation tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from server.settings import sqlite_url
from tests.support import ROOT
from tests.support.database import make_token
from tests.support.scenarios import create_experiment
from tests.support.tls import ServerFiles
from tests.support.waiting import wait_for

# A reaper every 0.2 s and claims held open at most 2 s: a test of agents sees a lost lease or an empty queue at once.
QUICK = {"COOP_REAP_SECONDS": "0.2", "COOP_MAX_CLAIM_WAIT_SECONDS": "2"}


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }


def launch(args: list[str], world: int) -> list[subprocess.CompletedProcess[str]]:
    """Start ``world`` real processes of ``args``, one per rank; wait for all."""
    port = free_port()
    processes = [
        subprocess.Popen(
            args, env=rank_env(rank, world, port), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for rank in range(world)
    ]
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(args, process.returncode, out, err))
    finally:  # a rank that hangs is killed with its peers, never left behind
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def coop_train(home: Path, seed: Path, arm: str, world: int, *extra: str) -> list[subprocess.CompletedProcess[str]]:
    args = [
        sys.executable,
        "-m",
        "experiment.cli",
        "train",
        "--home",
        str(home),
        "--model-dir",
        str(seed),
        "--arm",
        arm,
        *extra,
    ]
    return launch(args, world)


def stop_process(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM, seconds: float = 15.0) -> None:
    """Send ``sig`` and wait ``seconds`` for the process to end; kill it if it has not."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


def coop_server(*args: str, **environment: str) -> subprocess.CompletedProcess[str]:
    """``coop-server ARGS`` with COOP_* ``environment``, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "server", *args],
        cwd=ROOT,
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def coop_server_events(*args: str, **environment: str) -> list[dict[str, Any]]:
    """The JSON events of ``coop-server ARGS``, which must succeed."""
    done = coop_server(*args, **environment)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


class CoordinatorProcess:
    """``coop-server serve`` on a loopback port fixed at construction, so that a restart is found at the same
    address, over ``database_url`` (a SQLite file in ``home`` unless given), with ``environment``'s COOP_*
    settings; its output goes to home/server.log. ``operator`` names the operator token made at the first start
    (None: none). With ``certificate`` it serves HTTPS, and its client trusts that certificate's CA only. With
    ``namespace`` it runs in that network namespace on ``address`` (tests.support.hosts), which the test reaches over
    the operator's link."""

    def __init__(
        self,
        home: Path,
        database_url: str | None = None,
        *,
        migrate: bool = True,
        operator: str | None = "operator",
        certificate: ServerFiles | None = None,
        namespace: str | None = None,
        address: str = "127.0.0.1",
        **environment: str,
    ) -> None:
        self.home = home
        self.port = free_port()
        self.certificate = certificate
        self.place = ["ip", "netns", "exec", namespace] if namespace else []
        self.address = address
        self.url = f"{'http' if certificate is None else 'https'}://{address}:{self.port}"
        self.database_url = database_url or sqlite_url(home / "coordinator.sqlite3")
        self.environment = {"COOP_HOME": str(home), "COOP_DATABASE_URL": self.database_url, **environment}
        self.migrate = migrate
        self.operator_name = operator
        self.operator = ""
        self.process: subprocess.Popen[bytes] | None = None
        verify = True if certificate is None else certificate.client_context()
        self.http = httpx.Client(base_url=self.url, timeout=10.0, verify=verify)

    def start(self) -> None:
        args = [*self.place, sys.executable, "-m", "server", "serve", "--host", self.address, "--port", str(self.port)]
        if self.certificate is not None:
            args += ["--certfile", str(self.certificate.certfile), "--keyfile", str(self.certificate.keyfile)]
        with (self.home / "server.log").open("ab") as log:
            self.process = subprocess.Popen(
                [*args, *(["--migrate"] if self.migrate else [])],
                cwd=ROOT,
                env={**os.environ, **self.environment},
                stdout=log,
                stderr=log,
            )
        try:
            wait_for(self._answers, 60, "the coordinator to answer")
        except BaseException:
            self.stop()  # a start that fails leaves no process behind
            raise
        if self.operator_name and not self.operator:
            self.operator = make_token(self.database_url, "operator", self.operator_name)

    def rehome(self, home: Path, database_url: str | None = None) -> None:
        """From the next start on, serve ``home`` over ``database_url`` (else a SQLite file in ``home``) at the same
        address, with the same settings and operator token: a coordinator restored from a backup takes the place of
        the one it replaces."""
        assert self.process is None, "stop the coordinator before it moves"
        self.home = home
        self.database_url = database_url or sqlite_url(home / "coordinator.sqlite3")
        self.environment.update(COOP_HOME=str(home), COOP_DATABASE_URL=self.database_url)

    def _answers(self) -> bool:
        assert self.process is not None and self.process.poll() is None, f"the coordinator exited: {self.log()[-2000:]}"
        try:
            return self.http.get("/schema/openapi.json").status_code == 200
        except httpx.TransportError:
            return False

    def log(self) -> str:
        return (self.home / "server.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, seconds=20.0)
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
        return create_experiment(self, plan)

    def jobs(self, experiment_id: str) -> list[dict[str, Any]]:
        jobs: list[dict[str, Any]] = self.get(f"/api/experiments/{experiment_id}/jobs")
        return jobs


@contextmanager
def served(database_url: str, home: Path, **environment: str) -> Iterator[str]:
    """`coop-server serve` over the migrated ``database_url`` (``environment``: COOP_* settings), with no token
    made, until the block ends; its base URL."""
    coordinator = CoordinatorProcess(home, database_url, migrate=False, operator=None, **environment)
    try:
        coordinator.start()
        yield coordinator.url
    finally:
        coordinator.close()
