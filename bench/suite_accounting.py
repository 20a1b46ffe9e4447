"""A pytest plugin that accounts each test file's wall time and CPU seconds, its own and its children's.

Loaded by bench/test_suite_cpu.py (``-p suite_accounting``). For every test it reads ``os.times()`` before its set-up
and after its tear-down, and adds the difference to the test's group: its file, or the serving folder as one
(tests/conftest.py's ``_group``). Children's CPU is what the kernel adds to the worker when it reaps a child: every
process the tests start and wait for, with everything those processes reaped in turn. At the end each process writes
its groups as one JSON file into ``$COOP_SUITE_ACCOUNTING``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest

from tests.conftest import _group

_FIELDS = ("wall_s", "cpu_self_s", "cpu_children_s", "tests")
_groups: dict[str, dict[str, float]] = {}


def _now() -> tuple[float, float, float]:
    times = os.times()
    return time.monotonic(), times.user + times.system, times.children_user + times.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    before = _now()
    yield
    after = _now()
    group = _groups.setdefault(_group(item.nodeid.split("::", 1)[0]), dict.fromkeys(_FIELDS, 0.0))
    for field, a, b in zip(_FIELDS, after, before, strict=False):
        group[field] += a - b
    group["tests"] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    folder = os.environ.get("COOP_SUITE_ACCOUNTING")
    if folder and _groups:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(folder, f"{worker}-{os.getpid()}.json").write_text(json.dumps(_groups))
