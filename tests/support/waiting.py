"""One bounded wait: poll a condition until it holds, or fail the test saying what never happened."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

PAUSE = 0.1  # seconds between two polls


def wait_for(
    predicate: Callable[[], T | None], seconds: float, what: str | Callable[[], str], pause: float = PAUSE
) -> T:
    """The first truthy value ``predicate`` returns, polled every ``pause`` seconds; fails after ``seconds`` naming
    ``what`` it waited for (a callable ``what`` is read only then, so it may describe the state at the failure)."""
    deadline = time.monotonic() + seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            described = what() if callable(what) else what
            raise AssertionError(f"timed out after {seconds:g} s waiting for {described}")
        time.sleep(pause)
