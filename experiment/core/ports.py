"""A free TCP port on a host's address, for a process this one is about to start (a replica, a probe, a gang's
rendezvous): the port is free when asked, and the starting process binds it moments later."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port
