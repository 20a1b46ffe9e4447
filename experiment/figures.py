"""Report figures as inline SVG (matplotlib, no display): the report page and the web UI share them."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

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


def report_figures(report: Mapping[str, Any]) -> dict[str, str]:
    """The report's four figures from its JSON (as `coop report` writes it and the coordinator records it)."""
    arms = list(report["accuracy"])
    families = list(report["accuracy"]["seed"]["by_family"])
    variants = list(report["accuracy"]["seed"]["by_variant"])
    training = report["training"]
    return {
        "families": grouped_bars(
            "Test accuracy by family",
            families,
            {arm: [report["accuracy"][arm]["by_family"][f]["accuracy"] for f in families] for arm in arms},
            "accuracy",
        ),
        "variants": grouped_bars(
            "Test accuracy by wording (2 and 3 held out of training)",
            variants,
            {arm: [report["accuracy"][arm]["by_variant"][v]["accuracy"] for v in variants] for arm in arms},
            "accuracy",
        ),
        "losses": lines(
            "Training loss (token-weighted, nats)",
            {arm: list(enumerate(training[arm]["losses"], start=1)) for arm in training},
            "update",
            "loss",
        ),
        "updates": distributions("Update time", {arm: training[arm]["update_seconds"] for arm in training}, "seconds"),
    }
