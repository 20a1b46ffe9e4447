"""Statistics of the pre-registered comparisons: the exact one-sided sign (McNemar) test, mid-p,
Clopper-Pearson intervals, the retention bound, breakdowns, the one primary pass/fail, and the local-SGD design's
exact non-inferiority test.

SciPy is imported by the functions that compute with it: the coordinator loads these records (the report's shape) at
every start, and computes with them only when it reports (a start's CPU, with and without SciPy: docs/figures.md)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import msgspec
import numpy
from numpy.typing import NDArray

from experiment.core.errors import CoopError
from experiment.core.plan import StatisticsPlan

T = TypeVar("T")
Counts = NDArray[Any]  # outcomes of paired items, elementwise


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
    from scipy.stats import binomtest

    return float(binomtest(wins, wins + losses, 0.5, alternative="greater").pvalue)


def mid_p(wins: int, losses: int) -> float:
    """The mid-p variant: P(X > b) + P(X = b) / 2 (a secondary figure, less conservative)."""
    n = wins + losses
    if n == 0:
        return 1.0
    from scipy.stats import binom

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
    from scipy.stats import binomtest

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
    """One pre-registered condition of a verdict: the figure measured, the threshold it is held to, and whether it
    met it."""

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


def restricted_discordance(wins: Counts, losses: Counts, n: int, margin: float) -> Counts:
    """The maximum-likelihood P(win) + P(loss) under P(win) - P(loss) = -margin, for each (wins, losses): the
    root in [margin, 1] of n d^2 - (b + c + margin (c - b)) d - margin (b - c + (n - b - c) margin) = 0."""
    linear = wins + losses + margin * (losses - wins)
    constant = margin * (wins - losses + (n - wins - losses) * margin)
    root = (linear + numpy.sqrt(numpy.maximum(linear**2 + 4 * n * constant, 0.0))) / (2 * n)
    clipped: Counts = numpy.clip(root, margin, 1.0)
    return clipped


def noninferiority_score(wins: Counts, losses: Counts, n: int, margin: float) -> Counts:
    """Tango's score statistic for H0: P(win) - P(loss) <= -margin: (b - c + n margin) / sqrt(n (d - margin^2)),
    d the restricted estimate above; large when the arm is no worse than its control by the margin."""
    discordance = restricted_discordance(wins, losses, n, margin)
    score: Counts = (wins - losses + n * margin) / numpy.sqrt(n * (discordance - margin**2))
    return score


def _at_least_as_extreme(wins: int, losses: int, n: int, margin: float) -> tuple[Counts, Counts, Counts]:
    b, c = numpy.meshgrid(numpy.arange(n + 1), numpy.arange(n + 1), indexing="ij")
    possible = b + c <= n
    observed = noninferiority_score(numpy.array(wins), numpy.array(losses), n, margin)
    extreme = possible & (noninferiority_score(b, c, n, margin) >= observed - 1e-12)
    return b[extreme], c[extreme], (n - b - c)[extreme]


def _probability(b: Counts, c: Counts, rest: Counts, n: int, margin: float, discordance: float) -> float:
    """The trinomial probability of the outcomes (b, c, rest) on H0's boundary, P(win) + P(loss) = discordance."""
    from scipy.special import gammaln, xlogy

    win, loss = (discordance - margin) / 2, (discordance + margin) / 2
    log = (
        gammaln(n + 1)
        - gammaln(b + 1)
        - gammaln(c + 1)
        - gammaln(rest + 1)
        + xlogy(b, win)
        + xlogy(c, loss)
        + xlogy(rest, 1 - discordance)
    )
    return float(numpy.exp(log).sum())


def noninferiority_p_value(wins: int, losses: int, n: int, margin: float) -> float:
    """The exact unconditional one-sided test of H0: P(arm right) - P(control right) <= -margin on n paired items,
    ordered by Tango's score: the largest probability, over the nuisance P(win) + P(loss) on H0's boundary, of the
    outcomes scoring at least the observed one (searched on a grid of 1,001 points and refined around the
    largest). Wins: items the arm answers right and its control wrong; losses the other way."""
    if not 0 < margin < 1 or n <= 0 or wins < 0 or losses < 0 or wins + losses > n:
        raise CoopError("a non-inferiority test needs 0 < margin < 1 and wins + losses <= n paired items")
    from scipy.optimize import minimize_scalar

    b, c, rest = _at_least_as_extreme(wins, losses, n, margin)
    grid = numpy.linspace(margin, 1.0, 1001)
    tails = [_probability(b, c, rest, n, margin, float(d)) for d in grid]
    best = int(numpy.argmax(tails))
    refined = minimize_scalar(
        lambda d: -_probability(b, c, rest, n, margin, float(d)),
        bounds=(grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]),
        method="bounded",
    )
    return min(1.0, max(tails[best], -float(refined.fun)))
