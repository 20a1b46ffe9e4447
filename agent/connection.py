"""How the agent may reach its coordinator, decided before it sends anything: HTTPS verified against the operator's
CA file (or, without one, the system's CAs), or plain HTTP only to a loopback address, so that the agent token
never travels in clear between hosts."""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path

import httpx

from experiment.core.errors import CoopError

LOOPBACK_NAMES = {"localhost"}


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: traffic that never leaves this host."""
    if host.lower().rstrip(".") in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def tls_context(coordinator: str, ca_file: Path | None) -> ssl.SSLContext | None:
    """The context that verifies an https coordinator's certificate (its host name or address included), None for
    http on loopback; a CoopError for any other URL, or a CA file that cannot be used."""
    try:
        url = httpx.URL(coordinator)
    except httpx.InvalidURL as exc:
        raise CoopError(f"the coordinator URL {coordinator!r} is not a URL: {exc}") from None
    if url.scheme not in {"http", "https"} or not url.host:
        raise CoopError(f"the coordinator URL {coordinator!r} must be http(s)://HOST[:PORT]")
    if url.scheme == "http":
        if not is_loopback(url.host):
            raise CoopError(
                f"refusing plain http to the coordinator {coordinator}: its host {url.host} is not loopback, and the "
                "agent token would cross the network in clear; use https:// with --ca-file"
            )
        if ca_file is not None:
            raise CoopError(f"--ca-file verifies an https:// coordinator; {coordinator} is plain http")
        return None
    if ca_file is None:
        return ssl.create_default_context()
    try:
        # Only the operator's CA is trusted: the system's CAs are not loaded beside it.
        return ssl.create_default_context(cafile=str(ca_file))
    except FileNotFoundError:
        raise CoopError(f"the CA file {ca_file} does not exist") from None
    except ssl.SSLError as exc:  # before OSError, which it is
        raise CoopError(f"the CA file {ca_file} holds no PEM certificate: {exc.reason or exc}") from None
    except OSError as exc:
        raise CoopError(f"cannot read the CA file {ca_file}: {exc.strerror}") from None
