"""Statistics of the pre-registered comparisons: the exact one-sided sign (McNemar) test, mid-p,
Clopper-Pearson intervals, the retention bound, breakdowns, and the one primary pass/fail."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import msgspec
from scipy.stats import binom, binomtest

from experiment.core.errors import CoopError
from experiment.core.plan import StatisticsPlan

T = TypeVar("T")


class Paired(msgspec.Struct, frozen=True):
    """Discordant pairs of a paired comparison: wins b (baseline wrong, arm right) and losses c."""

    n: int
    wins: int
    losses: int
    gain: float  # (b - c) / n
    p_value: float  # exact one-sided: P(X >= b), X ~ Binomial(b + c, 1/2); 1 when b + c = 0
    mid_p_value: float


def paired_counts(baseline: Mapping[str, bool], arm: Mapping[str, bool]) -> tuple[int, int]:
    """Wins and losses over aligned ids; both sides must hold booleans for exactly the same unique ids."""
    if baseline.keys() != arm.keys():
        raise CoopError("paired outcomes must cover exactly the same task ids")
    for outcomes in (baseline, arm):
        if any(type(v) is not bool for v in outcomes.values()):
            raise CoopError("paired outcomes must be booleans")
    wins = sum(1 for k in baseline if arm[k] and not baseline[k])
    losses = sum(1 for k in baseline if baseline[k] and not arm[k])
    return wins, losses


def sign_test(wins: int, losses: int) -> float:
    """Exact one-sided p = sum_{k >= b}^{n} C(n, k) / 2^n with n = b + c; 1 when there is no discordant pair."""
    if wins < 0 or losses < 0:
        raise CoopError("wins and losses must not be negative")
    if wins + losses == 0:
        return 1.0
    return float(binomtest(wins, wins + losses, 0.5, alternative="greater").pvalue)


def mid_p(wins: int, losses: int) -> float:
    """The mid-p variant: P(X > b) + P(X = b) / 2 (a secondary figure, less conservative)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return float(binom.sf(wins, n, 0.5) + 0.5 * binom.pmf(wins, n, 0.5))


def paired(baseline: Mapping[str, bool], arm: Mapping[str, bool]) -> Paired:
    wins, losses = paired_counts(baseline, arm)
    n = len(baseline)
    return Paired(
        n=n,
        wins=wins,
        losses=losses,
        gain=(wins - losses) / n if n else 0.0,
        p_value=sign_test(wins, losses),
        mid_p_value=mid_p(wins, losses),
    )


def clopper_pearson(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact two-sided interval of a binomial proportion."""
    if n == 0:
        return (0.0, 1.0)
    interval = binomtest(successes, n).proportion_ci(confidence_level=confidence, method="exact")
    return (float(interval.low), float(interval.high))


class Retention(msgspec.Struct, frozen=True):
    n: int
    mean_change: float
    stdev: float
    upper: float  # mean(d) + z x stdev(d) / sqrt(n), d = loss_arm - loss_seed per probe


def retention_bound(seed: Mapping[str, float], arm: Mapping[str, float], z: float) -> Retention:
    if seed.keys() != arm.keys() or not seed:
        raise CoopError("retention losses must cover the same, non-empty set of probes")
    deltas = [arm[k] - seed[k] for k in sorted(seed)]
    spread = statistics.stdev(deltas) if len(deltas) > 1 else 0.0
    mean = statistics.fmean(deltas)
    return Retention(n=len(deltas), mean_change=mean, stdev=spread, upper=mean + z * spread / math.sqrt(len(deltas)))


class Cell(msgspec.Struct, frozen=True):
    correct: int
    n: int
    accuracy: float
    low: float
    high: float


def cell(outcomes: Sequence[bool]) -> Cell:
    correct = sum(outcomes)
    low, high = clopper_pearson(correct, len(outcomes))
    return Cell(
        correct=correct, n=len(outcomes), accuracy=correct / len(outcomes) if outcomes else 0.0, low=low, high=high
    )


def breakdown(items: Sequence[T], key: Callable[[T], str], correct: Callable[[T], bool]) -> dict[str, Cell]:
    """Accuracy with its interval per group (family, variant, ...), groups in sorted order."""
    groups: dict[str, list[bool]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(correct(item))
    return {name: cell(groups[name]) for name in sorted(groups)}


class Condition(msgspec.Struct, frozen=True):
    name: str
    value: float
    threshold: float
    passed: bool


class Verdict(msgspec.Struct, frozen=True):
    passed: bool
    conditions: list[Condition]


def primary_verdict(comparison: Paired, retention: Retention, rules: StatisticsPlan) -> Verdict:
    """The only pass/fail: clean-single vs seed on the test items, three conditions together."""
    conditions = [
        Condition(
            name="gain >= min_gain",
            value=comparison.gain,
            threshold=rules.min_gain,
            passed=comparison.gain >= rules.min_gain,
        ),
        Condition(
            name="p_value <= max_p_value",
            value=comparison.p_value,
            threshold=rules.max_p_value,
            passed=comparison.p_value <= rules.max_p_value,
        ),
        Condition(
            name="retention upper bound <= max_retention_upper_nats",
            value=retention.upper,
            threshold=rules.max_retention_upper_nats,
            passed=retention.upper <= rules.max_retention_upper_nats,
        ),
    ]
    return Verdict(passed=all(c.passed for c in conditions), conditions=conditions)


def within_margin(pair: Cell, single: Cell, margin: float) -> bool:
    """Descriptive: the pair arm's accuracy is no more than ``margin`` below the single arm's."""
    return pair.accuracy >= single.accuracy - margin
