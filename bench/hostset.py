"""Hosts in network namespaces for the link benches (scripts/namespaces.py; root), and link rates in bits."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NAMESPACES = [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "namespaces.py")]


def rate_bits(rate: str) -> float:
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(rate)


@contextlib.contextmanager
def hosts(count: int = 2, rate: str | None = None) -> Iterator[dict[str, Any]]:
    """A fresh set of ``count`` hosts and a coordinator, the private link shaped to ``rate``; its topology. The set
    is removed on exit."""
    prefix = f"coop-bench-{os.getpid()}"
    up = [*NAMESPACES, "up", "--prefix", prefix, "--hosts", str(count), *(["--rate", rate] if rate else [])]
    topology: dict[str, Any] = json.loads(subprocess.run(up, check=True, capture_output=True, text=True).stdout)
    try:
        yield topology
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run([*NAMESPACES, "down", "--prefix", prefix], check=True, capture_output=True)
