"""Report figures as inline SVG (matplotlib, no display): the report page and the web UI share them.

Figures are built on ``matplotlib.figure.Figure`` rather than pyplot: pyplot keeps every open figure in one
global registry, and the coordinator draws figures in its worker threads as well as its event loop."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence

from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from experiment.learning.stats import Cell
from experiment.report.localsgd import Communication
from experiment.report.model import Accuracy, Report
from experiment.report.spans import Span, TimelineFigure
from experiment.serving.servingrecord import PHASES, Metrics

# matplotlib's default colour cycle, by number, so that a timeline's group keeps its colour in every figure.
PALETTE = tuple(to_hex(colour) for colour in colormaps["tab10"](range(10)))
BASELINE_COLOUR = "#7f7f7f"
Colours = Mapping[str, str]


def arm_colours(arms: Sequence[str]) -> dict[str, str]:
    """One colour per arm, the same in every figure: the baseline (the plan's first arm) grey, the others the
    palette in the plan's order."""
    return {arm: BASELINE_COLOUR if number == 0 else PALETTE[(number - 1) % 10] for number, arm in enumerate(arms)}


def _figure(width: float = 7.5, height: float = 3.2) -> tuple[Figure, Axes]:
    figure = Figure(figsize=(width, height))
    return figure, figure.subplots()


def _svg(figure: Figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog so the SVG can be inlined in HTML


def grouped_bars(
    title: str,
    groups: Sequence[str],
    series: Mapping[str, Sequence[float]],
    ylabel: str,
    ylim: tuple[float, float] | None = (0, 1),
    colours: Colours | None = None,
) -> str:
    """One bar per series inside each group (e.g. accuracy per family, one bar per arm); ``ylim`` None lets the
    axis follow the values."""
    figure, axes = _figure()
    width = 0.8 / max(len(series), 1)
    for number, (name, values) in enumerate(series.items()):
        positions = [g + (number - (len(series) - 1) / 2) * width for g in range(len(groups))]
        axes.bar(positions, values, width=width, label=name, color=(colours or {}).get(name, PALETTE[number % 10]))
    axes.set_xticks(range(len(groups)), groups)
    if ylim is not None:
        axes.set_ylim(*ylim)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize="small", ncols=max(len(series), 1), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return _svg(figure)


def lines(
    title: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
    xlabel: str,
    ylabel: str,
    colours: Colours | None = None,
) -> str:
    figure, axes = _figure()
    for name, points in series.items():
        colour = (colours or {}).get(name)
        axes.plot([p[0] for p in points], [p[1] for p in points], label=name, color=colour, linewidth=1.2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize="small")
    return _svg(figure)


def distributions(title: str, series: Mapping[str, Sequence[float]], ylabel: str) -> str:
    """Box plots, one per series (e.g. update seconds per arm, latency per serving phase)."""
    figure, axes = _figure()
    names = [name for name, values in series.items() if values]
    axes.boxplot([series[name] for name in names], tick_labels=names)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    return _svg(figure)


def _rows(spans: Sequence[Span]) -> list[int]:
    """Each span's row inside its lane: the first row free at its start, so that overlapping spans of one lane
    (two jobs on one host at once) are stacked rather than drawn over each other."""
    rows = [0] * len(spans)
    ends: dict[str, list[float]] = {}
    for index in sorted(range(len(spans)), key=lambda i: (spans[i].start, spans[i].end)):
        span = spans[index]
        lane = ends.setdefault(span.lane, [])
        row = next((number for number, end in enumerate(lane) if end <= span.start), len(lane))
        if row == len(lane):
            lane.append(span.end)
        lane[row] = span.end
        rows[index] = row
    return rows


def timeline(chart: TimelineFigure) -> str:
    """Horizontal bars in lanes (in the order the spans first name them, top to bottom), one colour per group."""
    spans, groups = chart.spans, chart.groups
    lanes = list(dict.fromkeys(span.lane for span in spans))
    order = list(dict.fromkeys([*groups, *(span.group for span in spans)]))
    colour = {group: PALETTE[number % len(PALETTE)] for number, group in enumerate(order)}
    rows = _rows(spans)
    depth = {lane: 1 + max(row for span, row in zip(spans, rows, strict=True) if span.lane == lane) for lane in lanes}
    gap = 0.4 if max(depth.values()) > 1 else 0.0  # stacked lanes need room (and a rule) to tell them apart
    top: dict[str, float] = {}
    line = 0.0
    for lane in lanes:
        top[lane] = line
        line += depth[lane] + gap
    bottom = line - gap
    figure, axes = _figure(height=min(max(1.4 + 0.24 * bottom, 2.4), 14.0))
    left, right = min(s.start for s in spans), max(s.end for s in spans)
    shortest = (right - left) * 0.003  # a span too short to see still shows as a sliver
    for span, row in zip(spans, rows, strict=True):
        axes.barh(
            top[span.lane] + row + 0.5,
            max(span.end - span.start, shortest),
            left=span.start,
            height=0.8,
            color=colour[span.group],
            edgecolor="#1f2328" if span.failed else colour[span.group],
            linewidth=0.6,
            hatch="////" if span.failed else None,
        )
    if gap:
        for lane in lanes[1:]:
            axes.axhline(top[lane] - gap / 2, color="#d1d9e0", linewidth=0.8)
    centres = [top[lane] + depth[lane] / 2 for lane in lanes]
    every = max(1, len(lanes) // 32)  # a label for every lane while they fit
    axes.set_yticks(centres[::every], lanes[::every], fontsize="small" if len(lanes) > 12 else None)
    axes.set_ylim(bottom, 0)  # the first lane on top
    axes.set_xlabel(chart.xlabel)
    axes.set_ylabel(chart.ylabel)
    axes.set_title(chart.title)
    present = [group for group in order if any(span.group == group for span in spans)]
    handles: list[Artist] = [Patch(color=colour[group], label=group) for group in present]
    if any(span.failed for span in spans):
        handles.append(Patch(facecolor="white", edgecolor="#1f2328", hatch="////", label=chart.failed_label))
    if chart.marker is not None:
        x, label = chart.marker
        handles.append(axes.axvline(x, color="#1f2328", linestyle="--", linewidth=1.2, label=label))
    # Beside the axes: below them it would sit at a different distance for every height.
    axes.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes.grid(axis="x", color="#d1d9e0", linewidth=0.5)
    axes.set_axisbelow(True)
    return _svg(figure)


def serving_latency(phases: Mapping[str, Metrics]) -> str:
    """p50, p95 and p99 end-to-end latency per serving phase, from the report's serving metrics."""
    names = [phase for phase in PHASES if phase in phases]
    quantiles = {"p50": "median_e2el_ms", "p95": "p95_e2el_ms", "p99": "p99_e2el_ms"}
    return grouped_bars(
        "End-to-end request latency by phase",
        list(quantiles),
        {phase: [float(getattr(phases[phase], key) or 0.0) for key in quantiles.values()] for phase in names},
        "milliseconds",
        ylim=None,
    )


def report_figures(report: Report) -> dict[str, str]:
    """The report's figures: four, and a fifth (``serving``) when the report has a serving section."""
    colours = arm_colours(report.arms)
    training = report.training
    found = {
        "families": _accuracy_bars(report, "Test accuracy by family", lambda a: a.by_family, colours),
        "variants": _accuracy_bars(
            report, "Test accuracy by wording (2 and 3 held out of training)", lambda a: a.by_variant, colours
        ),
        "losses": lines(
            "Training loss (token-weighted, nats)",
            {arm: list(enumerate(run.losses, start=1)) for arm, run in training.items()},
            "update",
            "loss",
            colours=colours,
        ),
        "updates": distributions("Update time", {arm: run.update_seconds for arm, run in training.items()}, "seconds"),
    }
    if report.serving is not None:
        found["serving"] = serving_latency(report.serving.phases)
    if report.local_sgd is not None:
        found["communication"] = communication(report.local_sgd.communication)
    return found


def _accuracy_bars(
    report: Report, title: str, groups_of: Callable[[Accuracy], Mapping[str, Cell]], colours: Colours
) -> str:
    """Each arm's test accuracy in each group ``groups_of`` gives (by family, by wording), in the first arm's order."""
    accuracy = report.accuracy
    groups = list(groups_of(accuracy[report.arms[0]]))
    series = {arm: [groups_of(accuracy[arm])[group].accuracy for group in groups] for arm in report.arms}
    return grouped_bars(title, groups, series, "accuracy", colours=colours)


def communication(arms: Mapping[str, Communication]) -> str:
    """Per arm, the bytes a rank wrote while training (each rank's bar) beside the ring all-reduce's theory: the
    control and DiLoCo differ by the factor the method exists for."""
    names = list(arms)
    ranks = max(arms[arm].ranks for arm in names)
    series: dict[str, list[float]] = {"theory": [arms[arm].theory_bytes_per_rank for arm in names]}
    for rank in range(ranks):
        series[f"rank {rank} wrote"] = [
            float((arms[arm].written_bytes or [0] * ranks)[rank]) if rank < arms[arm].ranks else 0.0 for arm in names
        ]
    return grouped_bars("Bytes each rank sent while training", names, series, "bytes", ylim=None)
