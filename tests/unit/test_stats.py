from __future__ import annotations

import math
from fractions import Fraction

import numpy
import pytest
from scipy.optimize import minimize_scalar

from experiment.core.errors import CoopError
from experiment.core.plan import StatisticsPlan
from experiment.learning import stats

RULES = StatisticsPlan(
    min_gain=0.05, max_p_value=0.01, max_retention_upper_nats=0.02, retention_z=2.576, pair_margin=0.02
)


def _exact(b: int, c: int) -> Fraction:
    from math import comb

    n = b + c
    return Fraction(sum(comb(n, k) for k in range(b, n + 1)), 2**n)


def test_sign_test_b10_c2_is_79_over_4096() -> None:
    assert stats.sign_test(10, 2) == pytest.approx(79 / 4096, rel=1e-12)
    assert _exact(10, 2) == Fraction(79, 4096)


def test_sign_test_b9_c0_is_1_over_512() -> None:
    assert stats.sign_test(9, 0) == pytest.approx(1 / 512, rel=1e-12)


def test_no_discordant_pairs_gives_p_one() -> None:
    assert stats.sign_test(0, 0) == 1.0
    assert stats.mid_p(0, 0) == 1.0


@pytest.mark.parametrize(("b", "c"), [(1, 0), (5, 5), (3, 7), (20, 4), (0, 6)])
def test_sign_test_matches_the_binomial_sum_and_mid_p_is_smaller(b: int, c: int) -> None:
    assert stats.sign_test(b, c) == pytest.approx(float(_exact(b, c)), rel=1e-12)
    from math import comb

    n = b + c
    assert stats.mid_p(b, c) == pytest.approx(float(_exact(b, c) - Fraction(comb(n, b), 2**n) / 2), rel=1e-12)


def test_paired_counts_need_aligned_unique_boolean_outcomes() -> None:
    assert stats.paired_counts({"a": False, "b": True, "c": True}, {"a": True, "b": False, "c": True}) == (1, 1)
    with pytest.raises(CoopError, match="same task ids"):
        stats.paired_counts({"a": True}, {"b": True})
    with pytest.raises(CoopError, match="booleans"):
        stats.paired_counts({"a": 1}, {"a": True})  # type: ignore[dict-item]


def test_gain_is_wins_minus_losses_over_all_items() -> None:
    seed = {str(i): i < 10 for i in range(100)}
    arm = {str(i): i < 10 or 50 <= i < 60 for i in range(100)}
    result = stats.paired(seed, arm)
    assert (result.wins, result.losses, result.gain) == (10, 0, 0.10)
    assert result.p_value == pytest.approx(1 / 1024)


def test_retention_upper_bound_is_mean_plus_z_stdev_over_root_n() -> None:
    seed = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    arm = {"a": 1.1, "b": 1.9, "c": 3.2, "d": 4.0}
    bound = stats.retention_bound(seed, arm, 2.576)
    deltas = [0.1, -0.1, 0.2, 0.0]
    mean = sum(deltas) / 4
    sd = (sum((d - mean) ** 2 for d in deltas) / 3) ** 0.5
    assert bound.upper == pytest.approx(mean + 2.576 * sd / 2)


def test_clopper_pearson_contains_the_estimate() -> None:
    low, high = stats.clopper_pearson(169, 256)
    assert low < 169 / 256 < high
    assert stats.clopper_pearson(0, 10)[0] == 0.0
    assert stats.clopper_pearson(10, 10)[1] == 1.0


def test_primary_verdict_needs_all_three_conditions() -> None:
    strong = stats.Paired(n=256, wins=150, losses=4, gain=146 / 256, p_value=1e-30, mid_p_value=1e-30)
    calm = stats.Retention(n=128, mean_change=0.001, stdev=0.01, upper=0.0033)
    assert stats.primary_verdict(strong, calm, RULES).passed
    small_gain = stats.Paired(n=256, wins=12, losses=2, gain=10 / 256, p_value=0.0065, mid_p_value=0.004)
    verdict = stats.primary_verdict(small_gain, calm, RULES)
    assert not verdict.passed and [c.passed for c in verdict.conditions] == [False, True, True]
    forgetful = stats.Retention(n=128, mean_change=0.05, stdev=0.01, upper=0.0523)
    assert [c.passed for c in stats.primary_verdict(strong, forgetful, RULES).conditions] == [True, True, False]


def test_breakdown_groups_in_sorted_order() -> None:
    items = [("total", True), ("lookup", False), ("total", False), ("lookup", True), ("lookup", True)]
    table = stats.breakdown(items, key=lambda i: i[0], correct=lambda i: i[1])
    assert list(table) == ["lookup", "total"]
    assert (table["lookup"].correct, table["lookup"].n) == (2, 3)


# The local-SGD design's exact non-inferiority test, against a second implementation written here: the restricted
# estimate by numerical maximization of the likelihood, exact trinomial probabilities in integers, and the supremum
# on a dense grid.


def _restricted_by_search(b: int, c: int, n: int, margin: float) -> float:
    def negative_log_likelihood(d: float) -> float:
        win, loss = (d - margin) / 2, (d + margin) / 2
        terms = [(b, win), (c, loss), (n - b - c, 1 - d)]
        return -sum(count * math.log(p) for count, p in terms if count)

    found = minimize_scalar(
        negative_log_likelihood, bounds=(margin + 1e-12, 1 - 1e-12), method="bounded", options={"xatol": 1e-10}
    )
    return float(found.x)


def _score(b: int, c: int, n: int, margin: float) -> float:
    d = _restricted_by_search(b, c, n, margin)
    return (b - c + n * margin) / math.sqrt(n * (d - margin**2))


def _brute_p_value(b: int, c: int, n: int, margin: float, grid: int = 4001) -> float:
    observed = _score(b, c, n, margin)
    extreme = [(i, j) for i in range(n + 1) for j in range(n + 1 - i) if _score(i, j, n, margin) >= observed - 1e-9]
    best = 0.0
    for step in range(grid):
        d = margin + (1 - margin) * step / (grid - 1)
        win, loss = (d - margin) / 2, (d + margin) / 2
        total = sum(
            math.comb(n, i) * math.comb(n - i, j) * win**i * loss**j * (1 - d) ** (n - i - j) for i, j in extreme
        )
        best = max(best, total)
    return best


@pytest.mark.parametrize(("b", "c"), [(0, 0), (3, 3), (1, 5), (6, 1), (0, 4), (2, 0)])
def test_noninferiority_p_value_matches_a_brute_force_enumeration(b: int, c: int) -> None:
    n, margin = 24, 0.1
    ours, brute = stats.noninferiority_p_value(b, c, n, margin), _brute_p_value(b, c, n, margin)
    # Our supremum is refined past the grid, so it is never below the dense grid's and barely above it.
    assert brute - 1e-9 <= ours <= brute + 2e-4


def test_restricted_discordance_is_the_likelihoods_maximum() -> None:
    n, margin = 40, 0.05
    for b, c in [(0, 0), (5, 2), (2, 9), (0, 12), (10, 0), (20, 20)]:
        closed = float(stats.restricted_discordance(numpy.array(b), numpy.array(c), n, margin))
        assert closed == pytest.approx(_restricted_by_search(b, c, n, margin), abs=1e-6)


def test_noninferiority_test_never_rejects_more_often_than_its_level_on_the_null_boundary() -> None:
    n, margin, level = 14, 0.1, 0.05
    p = {(b, c): stats.noninferiority_p_value(b, c, n, margin) for b in range(n + 1) for c in range(n + 1 - b)}
    rejected = [outcome for outcome, value in p.items() if value <= level]
    assert rejected  # the test has power somewhere
    for step in range(201):
        d = margin + (1 - margin) * step / 200
        win, loss = (d - margin) / 2, (d + margin) / 2
        size = sum(
            math.comb(n, b) * math.comb(n - b, c) * win**b * loss**c * (1 - d) ** (n - b - c) for b, c in rejected
        )
        assert size <= level + 1e-9


def test_more_wins_never_weaken_the_evidence_of_non_inferiority() -> None:
    values = [stats.noninferiority_p_value(wins, 8, 256, 0.05) for wins in range(0, 16, 3)]
    assert values == sorted(values, reverse=True) and values[-1] < values[0]
    with pytest.raises(CoopError, match="non-inferiority"):
        stats.noninferiority_p_value(200, 100, 256, 0.05)
