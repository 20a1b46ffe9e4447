from __future__ import annotations

from fractions import Fraction

import pytest

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
