"""Report figures as inline SVG (matplotlib, no display): the report page and the web UI share them."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure

matplotlib.use("Agg")  # no display: chosen before pyplot is imported
import matplotlib.pyplot as plt

ARM_COLOURS = {"seed": "#7f7f7f", "clean-single": "#1f77b4", "damaged-single": "#d62728", "clean-pair": "#2ca02c"}


def _svg(figure: Figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog so the SVG can be inlined in HTML


def grouped_bars(title: str, groups: Sequence[str], series: Mapping[str, Sequence[float]], ylabel: str) -> str:
    """One bar per series inside each group (e.g. accuracy per family, one bar per arm)."""
    figure, axes = plt.subplots(figsize=(7.5, 3.2))
    width = 0.8 / max(len(series), 1)
    for number, (name, values) in enumerate(series.items()):
        positions = [g + (number - (len(series) - 1) / 2) * width for g in range(len(groups))]
        axes.bar(positions, values, width=width, label=name, color=ARM_COLOURS.get(name))
    axes.set_xticks(range(len(groups)), groups)
    axes.set_ylim(0, 1)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize="small", ncols=max(len(series), 1), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return _svg(figure)


def lines(title: str, series: Mapping[str, Sequence[tuple[float, float]]], xlabel: str, ylabel: str) -> str:
    figure, axes = plt.subplots(figsize=(7.5, 3.2))
    for name, points in series.items():
        axes.plot(
            [p[0] for p in points], [p[1] for p in points], label=name, color=ARM_COLOURS.get(name), linewidth=1.2
        )
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize="small")
    return _svg(figure)


def distributions(title: str, series: Mapping[str, Sequence[float]], ylabel: str) -> str:
    """Box plots, one per series (e.g. update seconds per arm, latency per serving phase)."""
    figure, axes = plt.subplots(figsize=(7.5, 3.2))
    names = [name for name, values in series.items() if values]
    axes.boxplot([series[name] for name in names], tick_labels=names)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    return _svg(figure)
