"""Two hosts and a coordinator in network namespaces of their own (scripts/namespaces.py), for the tests that run
the system across real links: made by ``hosts()``, removed when it exits, after a failure too."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from tests.support import ROOT

SCRIPT = [sys.executable, str(ROOT / "scripts" / "namespaces.py")]


def cut_link(topology: dict[str, Any], host: str, link: str, seconds: float) -> subprocess.Popen[bytes]:
    """Take ``host``'s ``link`` (public or private) down now, and up again after ``seconds`` (in the background)."""
    argv = [*SCRIPT, "cut", "--prefix", topology["prefix"], "--host", host, "--link", link, "--seconds", str(seconds)]
    return subprocess.Popen(argv)


@contextlib.contextmanager
def link_down(topology: dict[str, Any], host: str, link: str) -> Iterator[None]:
    """``host``'s ``link`` down once this is entered (the command has returned), up again when it exits."""
    where = ["--prefix", topology["prefix"], "--host", host, "--link", link]
    namespaces("cut", *where)
    try:
        yield
    finally:
        namespaces("mend", *where)


def namespaces(command: str, *args: str) -> str:
    return subprocess.run([*SCRIPT, command, *args], check=True, capture_output=True, text=True).stdout


@contextlib.contextmanager
def hosts(name: str, rate: str | None = None, count: int = 2) -> Iterator[dict[str, Any]]:
    """The topology (scripts/namespaces.py's JSON) of a fresh set of ``count`` hosts named after ``name`` and this
    process."""
    prefix = f"coop-{name}-{os.getpid()}"
    shaped = ["--rate", rate] if rate else []
    topology: dict[str, Any] = json.loads(namespaces("up", "--prefix", prefix, "--hosts", str(count), *shaped))
    try:
        yield topology
    finally:
        namespaces("down", "--prefix", prefix)
