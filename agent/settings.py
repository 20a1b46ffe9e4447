"""What an agent is started with (agent/cli.py reads it from the command line and the environment)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent import jobs


@dataclass(frozen=True)
class Settings:
    coordinator: str
    token: str
    name: str
    advertise_address: str
    work_dir: Path
    model_dir: Path
    plans_dir: Path
    reference_home: Path | None = None
    heartbeat_seconds: float = 10.0
    claim_wait_seconds: float = 20.0
    # Events are sent in batches: at most this many, at least this often while the command prints.
    batch_events: int = 500
    batch_seconds: float = 1.0
    # The grace period between TERM and KILL when the coordinator gives no deadline.
    grace_seconds: float = 30.0
    kinds: tuple[str, ...] = ()
    # The CA that signed an https coordinator's certificate (None: the system's CAs).
    ca_file: Path | None = None
    # The host's private link: the interface a gang's collectives use, and its address, where the gang meets.
    private: jobs.PrivateLink | None = None
