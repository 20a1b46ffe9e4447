"""The coordinator's settings: one frozen dataclass read from the environment."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from experiment.core.errors import CoopError
from server import failpoints

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise CoopError(f"{name}={raw!r} is not a switch; use one of {sorted(_TRUE | _FALSE)}")


def _number(name: str, default: float, low: float, high: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise CoopError(f"{name}={raw!r} is not a number") from exc
    if not low <= value <= high:
        raise CoopError(f"{name}={value} is outside {low}..{high}")
    return value


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    # An attempt whose agent has not renewed its lease for this long is lost.
    lease_seconds: float = 60.0
    # Agents are asked to heartbeat this often; it must be well under the lease.
    heartbeat_seconds: float = 15.0
    # How often the background reaper looks for expired leases.
    reap_seconds: float = 5.0
    # The protocol publishes every answer and measurement, so reads are public unless switched off.
    public_read: bool = True
    # The longest a claim may wait for work (long poll).
    max_claim_wait_seconds: float = 30.0
    # A waiting claim is woken when work is queued (server.dispatch.waiters); unwoken, it looks again this often.
    claim_recheck_seconds: float = 5.0
    # A job whose attempt was lost is retried as a new attempt until it has had this many.
    max_attempts: int = 3
    # Body limit for every request; larger bodies are refused with 413.
    max_body_bytes: int = 8 * 1024 * 1024
    # Blobs (evidence files) stream to disk and may be larger than other bodies, up to this size.
    max_blob_bytes: int = 1024 * 1024 * 1024
    # A gang whose ranks are not all claimed this long after rank 0's claim is requeued (its attempts
    # are cancelled), so that a half-formed gang never holds an agent forever.
    gang_form_seconds: float = 300.0
    # Rendezvous ports for multi-rank jobs are chosen from [base, base + span).
    rendezvous_port_base: int = 29500
    rendezvous_port_span: int = 500
    # The coordinator speaks TLS (coop-server serve --certfile/--keyfile): the web UI's cookies are then Secure, so
    # that a browser never sends the session over plain HTTP. Set by serve, never from the environment.
    tls: bool = False
    # Points at which the coordinator kills itself (server.failpoints; tests and the chaos bench), by visit.
    failpoints: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.heartbeat_seconds >= self.lease_seconds:
            raise CoopError(
                f"heartbeat ({self.heartbeat_seconds}s) must be shorter than the lease ({self.lease_seconds}s)"
            )

    @property
    def blob_dir(self) -> Path:
        return self.home / "blobs"


def sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path.resolve()}"


def from_env() -> Settings:
    settings = _read_env()
    last = settings.rendezvous_port_base + settings.rendezvous_port_span - 1
    if last > 65535:
        raise CoopError(f"COOP_RENDEZVOUS_PORT_BASE + COOP_RENDEZVOUS_PORT_SPAN - 1 = {last} is past port 65535")
    return settings


def _read_env() -> Settings:
    home = Path(os.environ.get("COOP_HOME") or ".coop")
    url = os.environ.get("COOP_DATABASE_URL") or sqlite_url(home / "coordinator.sqlite3")
    return Settings(
        home=home,
        database_url=url,
        lease_seconds=_number("COOP_LEASE_SECONDS", 60.0, 0.1, 86_400.0),
        heartbeat_seconds=_number("COOP_HEARTBEAT_SECONDS", 15.0, 0.05, 3_600.0),
        reap_seconds=_number("COOP_REAP_SECONDS", 5.0, 0.05, 3_600.0),
        public_read=_flag("COOP_PUBLIC_READ", True),
        max_claim_wait_seconds=_number("COOP_MAX_CLAIM_WAIT_SECONDS", 30.0, 0.0, 600.0),
        claim_recheck_seconds=_number("COOP_CLAIM_RECHECK_SECONDS", 5.0, 0.05, 3_600.0),
        max_attempts=int(_number("COOP_MAX_ATTEMPTS", 3, 1, 100)),
        max_body_bytes=int(_number("COOP_MAX_BODY_BYTES", 8 * 1024 * 1024, 1024, 1 << 32)),
        max_blob_bytes=int(_number("COOP_MAX_BLOB_BYTES", 1024 * 1024 * 1024, 1024, 1 << 40)),
        gang_form_seconds=_number("COOP_GANG_FORM_SECONDS", 300.0, 0.1, 86_400.0),
        # A gang's rendezvous port is one of BASE .. BASE + SPAN - 1 (the firewall opens that range between the hosts).
        rendezvous_port_base=int(_number("COOP_RENDEZVOUS_PORT_BASE", 29500, 1024, 65535)),
        rendezvous_port_span=int(_number("COOP_RENDEZVOUS_PORT_SPAN", 500, 1, 10_000)),
        failpoints=failpoints.parse(os.environ.get("COOP_FAILPOINTS", "")),
    )
