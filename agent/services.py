"""The services an agent keeps running beside its jobs: a vLLM replica and the probe in front of it.

A replica-start job starts both (``coop replica`` and ``coop probe``, each in its own process group), waits
until the probe's ``/health`` answers (the probe listens only once the replica has answered dev tasks as the
evaluation of its model did), and reports their URLs and that check; they outlive the job, not the agent (each
is an agent.processes group). A replica-stop job, or the agent's own shutdown, stops them: TERM, the grace
period, then KILL.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec

from agent import processes
from agent.spool import Group, Spool
from experiment.core.errors import CoopError
from experiment.core.ports import free_port
from experiment.serving.agreement import Agreement


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    group: Group


@dataclass(frozen=True)
class Launch:
    """What a replica and its probe are started with."""

    key: str  # the experiment: at most one replica of it per host
    coop: list[str]  # how to run a ``coop`` command
    model_dir: Path  # the checkpoint the replica serves
    seed_dir: Path  # the seed's folder (the probe's tokenizer and chat template)
    home: Path  # the experiment's home (the probe's prepared dev tasks)
    reference: Path  # the dev evaluation of the served arm, which the probe checks the replica's answers against
    model_identity: str  # the name the replica serves the checkpoint under
    numerics: str  # the plan's evaluation numerics: the reference evaluation answered in it, the replica serves in it
    device: str  # the plan's device (cpu or cuda), passed to the replica: it need not import torch to find it
    address: str  # the host's address: the replica and the probe listen on it, and other hosts reach the probe there
    token_file: Path  # the probe's bearer token
    env: dict[str, str]
    logs: Path  # a folder for the replica's and the probe's logs
    cwd: Path
    startup_seconds: float = 900.0


@dataclass
class Replica:
    model_identity: str
    replica_url: str
    probe_url: str
    services: tuple[Service, Service]
    identity: Agreement | None  # the probe's check of the replica's answers against the evaluation (its /health)


class _Health(msgspec.Struct, frozen=True):
    """What the agent reads of the probe's ``/health`` body (experiment.serving.probe.ProbeHealth)."""

    identity: Agreement | None = None


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _last_words(log: Path) -> str:
    """The refusal a ``coop`` command printed last (``coop: ...``, with the lines after it: a refused identity check
    names each differing task on its own line), else the log's last line."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    starts = [number for number, line in enumerate(lines) if line.startswith("coop: ")]
    if starts:
        return "\n".join(lines[starts[-1] :])[:3000]
    return (lines or ["(no output)"])[-1][:3000]


def _wait_healthy(
    watched: list[tuple[Service, Path]], url: str, token: str, seconds: float, stopping: threading.Event
) -> Agreement | None:
    """The probe's check of the replica (the identity in its ``/health`` body) at ``url``, once it answers 200;
    fails as soon as a watched service (the replica or the probe, each with its log) exits."""
    deadline = time.monotonic() + seconds
    headers = {"Authorization": f"Bearer {token}"}
    # One client for every poll: a client made for each costs about 20 ms of CPU (its TLS context).
    with httpx.Client(headers=headers, timeout=2.0) as client:
        while time.monotonic() < deadline and not stopping.is_set():
            for service, log in watched:
                if service.process.poll() is not None:
                    code, words = service.process.returncode, _last_words(log)
                    raise CoopError(f"the {service.name} exited with {code} before the probe was healthy: {words}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                reply = client.get(f"{url}/health")
                if reply.status_code == 200:
                    return msgspec.json.decode(reply.content, type=_Health).identity
            stopping.wait(0.5)
    raise CoopError(f"the probe at {url} was not healthy within {seconds:g}s")


class Services:
    """Replicas by experiment; at most one per experiment on a host."""

    def __init__(self, grace: float, spool: Spool) -> None:
        self.grace = grace
        self.spool = spool
        self._replicas: dict[str, Replica] = {}
        self._lock = threading.Lock()

    def _spawn(self, name: str, key: str, argv: list[str], cwd: Path, env: dict[str, str], log: Path) -> Service:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            what = f"the {name} of experiment {key}"
            process, group = processes.start(self.spool, what, argv, cwd=cwd, env=env, stdout=out, stderr=out)
        return Service(name, process, group)

    def _end(self, service: Service) -> None:
        """TERM, the grace period, KILL: the service's whole process group, which is then no longer recorded."""
        processes.end([service.group], self.grace)
        with contextlib.suppress(subprocess.TimeoutExpired):
            service.process.wait(timeout=30)
        self.spool.forget_group(service.group)

    def start(self, launch: Launch, stopping: threading.Event) -> Replica:
        key, logs = launch.key, launch.logs
        with self._lock:
            if key in self._replicas:
                raise CoopError(f"a replica of experiment {key} already runs on this host")
        replica_port, probe_port = free_port(launch.address), free_port(launch.address)
        # Both listen on the host's address (never a wildcard): the probe is what other hosts reach.
        replica_url = _url(launch.address, replica_port)
        argv = [*launch.coop, "replica", "--model-dir", str(launch.model_dir)]
        argv += ["--served-model-name", launch.model_identity, "--dtype", launch.numerics, "--device", launch.device]
        argv += ["--host", launch.address, "--port", str(replica_port), "--grace", str(self.grace)]
        replica = self._spawn("replica", key, argv, launch.cwd, launch.env, logs / "replica.log")
        argv = [*launch.coop, "probe", "--home", str(launch.home), "--model-dir", str(launch.seed_dir)]
        argv += ["--replica", replica_url, "--bind", launch.address, "--port", str(probe_port)]
        argv += ["--token-file", str(launch.token_file), "--expect", str(launch.reference)]
        probe = self._spawn("probe", key, argv, launch.cwd, launch.env, logs / "probe.log")
        token = launch.token_file.read_text().strip()
        try:
            watched = [(replica, logs / "replica.log"), (probe, logs / "probe.log")]
            identity = _wait_healthy(watched, _url(launch.address, probe_port), token, launch.startup_seconds, stopping)
        except CoopError:
            for service in (probe, replica):
                self._end(service)
            raise
        probe_url = _url(launch.address, probe_port)
        started = Replica(launch.model_identity, replica_url, probe_url, (replica, probe), identity)
        with self._lock:
            self._replicas[key] = started
        return started

    def holds_replica(self) -> bool:
        """Whether a replica runs on this host (its accelerator's memory is then the replica's)."""
        with self._lock:
            return bool(self._replicas)

    def stop(self, key: str) -> bool:
        """Stop the experiment's replica and probe; False when none runs here."""
        with self._lock:
            replica = self._replicas.pop(key, None)
        if replica is None:
            return False
        probe, vllm = replica.services[1], replica.services[0]
        self._end(vllm)  # the replica first: the probe then answers 503, as a stopped host would
        self._end(probe)
        return True

    def stop_all(self) -> None:
        for key in list(self._replicas):
            self.stop(key)
