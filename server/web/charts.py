"""The UI's figures: experiment.report.figures' SVG (the report's own matplotlib code), kept while the data stays
the same, since htmx asks for the live parts every few seconds and a figure takes a while to draw. matplotlib is
imported by the first figure drawn, not by the coordinator's start."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import msgspec

from experiment.report.model import Report, read_report
from experiment.report.spans import TimelineFigure

Series = tuple[tuple[str, tuple[tuple[float, float], ...]], ...]


@functools.lru_cache(maxsize=32)
def _lines(title: str, series: Series, xlabel: str, ylabel: str) -> str:
    from experiment.report import figures

    return figures.lines(title, {name: list(points) for name, points in series}, xlabel, ylabel)


def lines(title: str, by_name: Mapping[str, Sequence[tuple[float, float]]], xlabel: str, ylabel: str) -> str | None:
    """One line per name; None when no name has a point."""
    series = tuple((name, tuple(points)) for name, points in by_name.items() if points)
    return _lines(title, series, xlabel, ylabel) if series else None


def losses(by_arm: Mapping[str, Sequence[tuple[int, float]]]) -> str | None:
    """Training loss per update, one line per arm; None before any update is recorded."""
    series = tuple((arm, tuple((float(s), loss) for s, loss in points)) for arm, points in by_arm.items() if points)
    return _lines("Training loss (token-weighted, nats)", series, "update", "loss") if series else None


@functools.lru_cache(maxsize=32)
def _distributions(title: str, series: tuple[tuple[str, tuple[float, ...]], ...], ylabel: str) -> str:
    from experiment.report import figures

    return figures.distributions(title, {name: list(values) for name, values in series}, ylabel)


def distributions(title: str, by_name: Mapping[str, Sequence[float]], ylabel: str) -> str | None:
    series = tuple((name, tuple(values)) for name, values in by_name.items() if values)
    return _distributions(title, series, ylabel) if series else None


@functools.lru_cache(maxsize=32)
def _timeline(chart: TimelineFigure) -> str:
    from experiment.report import figures

    return figures.timeline(chart)


def timeline(chart: TimelineFigure) -> str | None:
    """Bars in lanes (figures.timeline); None when there is nothing to draw."""
    return _timeline(chart) if chart.spans else None


@functools.lru_cache(maxsize=8)
def _report(text: bytes) -> dict[str, str]:
    from experiment.report import figures

    return figures.report_figures(read_report(text))


def report(document: Report) -> dict[str, str]:
    """The report's figures; the recorded report never changes, so its text keys the cache."""
    return _report(msgspec.json.encode(document))
