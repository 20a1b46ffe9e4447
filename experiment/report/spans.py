"""The bars a timeline figure is drawn from (experiment.report.figures), as plain data: the coordinator's pages
build them without importing matplotlib, which only drawing needs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One bar of a timeline: something in ``lane`` (a host, a request) from ``start`` to ``end`` (on the
    figure's x axis), coloured by its ``group`` (a job kind, an endpoint)."""

    lane: str
    start: float
    end: float
    group: str
    failed: bool = False  # drawn hatched


@dataclass(frozen=True)
class TimelineFigure:
    """A timeline figure: its bars in lanes, its title and axes, the groups whose order fixes their colours (others
    follow in order of appearance), a dashed vertical line at ``marker`` (x, label), and what a hatched bar means."""

    title: str
    spans: tuple[Span, ...]
    xlabel: str
    ylabel: str = ""
    groups: tuple[str, ...] = ()
    marker: tuple[float, str] | None = None
    failed_label: str = "failed"
