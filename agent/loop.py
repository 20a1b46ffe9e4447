"""The agent: register, then three threads: the heartbeat (heartbeat.py), the uploader draining the spool to the
coordinator whenever it answers (uploader.py), and the claim loop here, which hands each job it is given to the
supervisor (supervisor.py), one at a time."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading

import msgspec
import psutil

from agent import connection
from agent.client import Coordinator, Stopping, Unreachable, Untrusted, forever
from agent.heartbeat import Heartbeat
from agent.leases import Leases
from agent.settings import Settings
from agent.spool import Spool
from agent.supervisor import Supervisor
from agent.uploader import Uploader
from experiment import wire

log = logging.getLogger("coop.agent")
__all__ = ["Agent", "Settings", "gpu_facts", "host_facts", "run"]


def host_facts(name: str) -> dict[str, str]:
    """The labels registered with the coordinator: CPU count, memory and the GPUs ``gpu_facts`` finds."""
    return {
        "name": name,
        "cpu_count": str(os.cpu_count() or 0),
        "memory_bytes": str(psutil.virtual_memory().total),
        **gpu_facts(),
    }


def gpu_facts() -> dict[str, str]:
    """The GPUs nvidia-smi lists (none without it). Asked in nvidia-smi's own process: the agent never makes a
    CUDA context, which would hold memory on the card for as long as it runs, under its jobs' training and vLLM."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    query = [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    try:
        listed = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
        rows = [line.rsplit(",", 1) for line in listed.splitlines() if line.strip()]
        facts = {"gpu_count": str(len(rows))}
        for index, (gpu, mib) in enumerate(rows):
            facts[f"gpu{index}_name"] = gpu.strip()
            facts[f"gpu{index}_memory_bytes"] = str(int(mib) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        log.warning("nvidia-smi did not list the GPUs (%s); registering none", exc)
        return {}
    return facts


class Agent:
    def __init__(self, settings: Settings, client: Coordinator, spool: Spool) -> None:
        self.settings, self.client, self.spool = settings, client, spool
        self.stopping = threading.Event()
        self.leases = Leases()
        self.supervisor = Supervisor(settings, client, spool, self.leases, self.stopping)
        self.services = self.supervisor.services
        self.uploader = Uploader(client, spool, self.leases, self._distrust)
        self.heartbeat = Heartbeat(
            client, self.leases, self.supervisor, settings.heartbeat_seconds, settings.grace_seconds, self._distrust
        )
        self._lock = threading.Lock()
        # Set by whichever thread first finds that the coordinator's certificate does not verify; the agent stops.
        self.untrusted: Untrusted | None = None

    def run(self) -> None:
        self.supervisor.recover()
        for attempt_id in self.spool.undelivered():
            self.leases.claimed(attempt_id)
        threading.Thread(target=self.uploader.loop, name="sender", daemon=True).start()
        try:
            agent = forever(
                lambda: self.client.register(
                    wire.AgentRegister(
                        address=self.settings.advertise_address,
                        labels=host_facts(self.settings.name),
                        private_address=None if self.settings.private is None else self.settings.private.address,
                    )
                ),
                self.stopping,
            )
            log.info("registered as %s (%s)", agent.name, agent.id)
            threading.Thread(target=self.heartbeat.loop, args=(self.stopping,), name="heartbeat", daemon=True).start()
            self._claim_loop()
        except Stopping:
            pass
        except Untrusted as exc:
            self._distrust(exc)
        self.services.stop_all()
        if self.untrusted is not None:
            raise self.untrusted  # nothing more can be sent: the spool keeps what is pending for the next run
        self.uploader.drain(timeout=10.0)

    def _distrust(self, exc: Untrusted) -> None:
        """Stop the agent: a coordinator whose certificate does not verify gets nothing from it."""
        with self._lock:
            if self.untrusted is None:
                self.untrusted = exc
        self.stopping.set()

    def claimable(self) -> list[wire.JobKind]:
        """The kinds this agent claims now: its settings' (every kind by default), less the accelerator's kinds
        while a replica holds this host's GPU."""
        kinds = [kind for kind in wire.SPECS if not self.settings.kinds or kind in self.settings.kinds]
        if self.services.holds_replica():
            kinds = [kind for kind in kinds if kind not in wire.ACCELERATOR_KINDS]
        return kinds  # type: ignore[return-value]

    def _claim_loop(self) -> None:
        key: str | None = None
        while not self.stopping.is_set():
            kinds = self.claimable()
            if not kinds:
                self.stopping.wait(1.0)
                continue
            request = wire.ClaimRequest(wait_seconds=self.settings.claim_wait_seconds, kinds=kinds)
            if key is None:
                key = self.leases.new_claim()
            try:
                reply = self.client.claim(msgspec.structs.replace(request, claim_key=key))
            except Unreachable as exc:
                # The coordinator may have leased an attempt and lost the reply: the same key gets it back.
                log.warning("claim: %s", exc)
                self.stopping.wait(1.0)
                continue
            assignment, key = reply.assignment, None
            self.leases.claimed(None if assignment is None else assignment.attempt_id)
            if assignment is not None:
                self.supervisor.supervise(assignment)


def run(settings: Settings) -> None:
    """Run the agent until SIGTERM or SIGINT; a CoopError when the coordinator may not, or did not, get its token,
    or when the private link is not this host's."""
    if settings.private is not None:
        settings.private.check()
    verify = connection.tls_context(settings.coordinator, settings.ca_file)
    client = Coordinator(settings.coordinator, settings.token, verify=True if verify is None else verify)
    spool = Spool(settings.work_dir / "spool.sqlite3")
    agent = Agent(settings, client, spool)

    def stop(signum: int, frame: object) -> None:
        log.info("signal %d: stopping", signum)
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        agent.run()
    finally:
        client.close()
        spool.close()
