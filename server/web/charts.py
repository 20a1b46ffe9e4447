"""The UI's figures: experiment.figures' SVG (the report's own matplotlib code), kept while the data stays
the same, since htmx asks for the live parts every few seconds and a figure takes a while to draw."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

from experiment import figures

Series = tuple[tuple[str, tuple[tuple[float, float], ...]], ...]


@functools.lru_cache(maxsize=32)
def _lines(title: str, series: Series, xlabel: str, ylabel: str) -> str:
    return figures.lines(title, {name: list(points) for name, points in series}, xlabel, ylabel)


def losses(by_arm: Mapping[str, Sequence[tuple[int, float]]]) -> str | None:
    """Training loss per update, one line per arm; None before any update is recorded."""
    series = tuple((arm, tuple((float(s), loss) for s, loss in points)) for arm, points in by_arm.items() if points)
    return _lines("Training loss (token-weighted, nats)", series, "update", "loss") if series else None


@functools.lru_cache(maxsize=32)
def _distributions(title: str, series: tuple[tuple[str, tuple[float, ...]], ...], ylabel: str) -> str:
    return figures.distributions(title, {name: list(values) for name, values in series}, ylabel)


def distributions(title: str, by_name: Mapping[str, Sequence[float]], ylabel: str) -> str | None:
    series = tuple((name, tuple(values)) for name, values in by_name.items() if values)
    return _distributions(title, series, ylabel) if series else None


@functools.lru_cache(maxsize=8)
def _report(text: str) -> dict[str, str]:
    return figures.report_figures(json.loads(text))


def report(document: Mapping[str, Any]) -> dict[str, str]:
    """The report's four figures; the recorded report never changes, so its text keys the cache."""
    return _report(json.dumps(document, sort_keys=True))
