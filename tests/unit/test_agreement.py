"""Served answers against the evaluation's: equal ids on CPU, equal outcomes on GPU, degenerate answers refused."""

from __future__ import annotations

import pytest

from experiment.core import tasks
from experiment.learning.records import Answer
from experiment.serving import agreement

EOS, PAD = 2, 0
RIGHT = tasks.Check(correct=True, valid_json_object=True, reason="correct")
WRONG = tasks.Check(correct=False, valid_json_object=True, reason="wrong_schema_or_value")


def _answer(index: int, output_ids: list[int], check: tasks.Check) -> Answer:
    return Answer(
        id=f"t{index}",
        index=index,
        family="lookup",
        variant=0,
        input_dependent=True,
        prompt_ids=[1, 5],
        output_ids=output_ids,
        text="",
        seconds=0.0,
        ended_with_eos=output_ids[-1:] == [EOS],
        hit_token_limit=False,
        check=check,
    )


EXPECTED = {a.id: a for a in (_answer(0, [7, 8, 9, EOS], RIGHT), _answer(1, [7, 3, EOS], WRONG))}


def _served(task_id: str, ids: list[int], check: tasks.Check, text: str = "") -> agreement.ServedAnswer:
    return agreement.ServedAnswer(task_id, ids, text, check)


def test_identical_answers_agree_on_every_token() -> None:
    served = [_served(a.id, a.output_ids, a.check) for a in EXPECTED.values()]
    result = agreement.compare(EXPECTED, served)
    assert (result.tasks, result.identical, result.same_outcome) == (2, 2, 2)
    assert (result.matched_tokens, result.expected_tokens, result.token_agreement) == (7, 7, 1.0)
    assert (result.correct, result.expected_correct) == (1, 1)
    assert agreement.refusal(EXPECTED, served, "cpu") is None
    assert agreement.refusal(EXPECTED, served, "cuda") is None


def test_one_differing_token_is_refused_on_cpu_and_named() -> None:
    served = [
        _served("t0", [7, 8, 4, EOS], RIGHT, '{"a": 4}'),  # the same outcome, another third token
        _served("t1", [7, 3, EOS], WRONG),
    ]
    result = agreement.compare(EXPECTED, served)
    assert (result.identical, result.same_outcome, result.matched_tokens) == (1, 2, 2 + 3)
    assert result.token_agreement == pytest.approx(5 / 7)
    refused = agreement.refusal(EXPECTED, served, "cpu")
    assert refused is not None
    assert refused.splitlines() == [
        "1 of 2 answers differ from the evaluation's output ids (at most 0 may on cpu):",
        "task t0 (dev index 0) from output token 2: served '{\"a\": 4}' (correct) | evaluated '' (correct)",
    ]
    # On a GPU ids may differ in a last bit; the strict-check outcomes decide.
    assert agreement.refusal(EXPECTED, served, "cuda") is None


def _many(count: int) -> dict[str, Answer]:
    return {f"t{i}": _answer(i, [7, i + 10, EOS], RIGHT) for i in range(count)}


@pytest.mark.parametrize(("count", "allowed"), [(8, 0), (15, 0), (16, 1), (31, 1), (32, 2)])
def test_a_gpu_tolerates_one_other_outcome_in_sixteen_and_names_each(count: int, allowed: int) -> None:
    expected = _many(count)
    assert agreement.allowed_differences(count, "cuda") == allowed
    assert agreement.allowed_differences(count, "cpu") == 0
    flipped = {f"t{i}" for i in range(allowed + 1)}

    def served(flips: set[str]) -> list[agreement.ServedAnswer]:
        return [
            _served(
                a.id,
                [7, 4, EOS] if a.id in flips else a.output_ids,
                WRONG if a.id in flips else RIGHT,
                "wrong" if a.id in flips else "right",
            )
            for a in expected.values()
        ]

    assert agreement.refusal(expected, served(set(sorted(flipped)[:allowed])), "cuda") is None
    refused = agreement.refusal(expected, served(flipped), "cuda")
    assert refused is not None
    lines = refused.splitlines()
    assert lines[0] == (
        f"{allowed + 1} of {count} strict-check outcomes differ from the evaluation's (at most {allowed} may on cuda):"
    )
    assert lines[1:] == [
        f"task {task} (dev index {task[1:]}) from output token 1: served 'wrong' (wrong_schema_or_value) | "
        "evaluated '' (correct)"
        for task in sorted(flipped, key=lambda t: int(t[1:]))
    ]


def test_the_probe_asks_enough_tasks_for_the_gpu_rule_to_tolerate_a_near_tie() -> None:
    # The rule's two error rates at the probe's size, by the binomial tail (scipy) against a direct sum: a replica
    # whose near-ties flip 1% of outcomes is refused, and a broken stack that flips 25% passes, each under 1%.
    from math import comb

    from scipy.stats import binom

    n = agreement.identity_tasks("cuda")
    k = agreement.allowed_differences(n, "cuda")
    assert (n, k) == (32, 2)
    refuse_benign = 1 - sum(comb(n, i) * 0.01**i * 0.99 ** (n - i) for i in range(k + 1))
    pass_broken = sum(comb(n, i) * 0.25**i * 0.75 ** (n - i) for i in range(k + 1))
    assert refuse_benign == pytest.approx(binom.sf(k, n, 0.01)) and refuse_benign < 0.005
    assert pass_broken == pytest.approx(binom.cdf(k, n, 0.25)) and pass_broken < 0.01
    # The start gate this replaces (all of 8 outcomes equal) refused a 1% near-tie rate's replica 7.7% of the time.
    assert binom.sf(0, 8, 0.01) > 0.07
    assert agreement.identity_tasks("cpu") == 8


def test_a_shorter_answer_differs_where_it_ends() -> None:
    result = agreement.compare(EXPECTED, [_served("t0", [7, 8], WRONG)])
    assert result.identical == 0 and result.matched_tokens == 2
    assert result.first_difference is not None and "at output token 2" in result.first_difference


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        ([0] * 96, "only padding (96 x token id 0)"),
        ([0, EOS], "only padding (1 x token id 0)"),
        ([9, 9, 9, 9], "one token repeated (4 x token id 9)"),
        ([9, 9, EOS], "one token repeated (2 x token id 9)"),
    ],
)
def test_padding_or_one_repeated_token_is_no_answer(ids: list[int], why: str) -> None:
    assert agreement.degenerate(ids, EOS, PAD) == why


@pytest.mark.parametrize("ids", [[EOS], [9, EOS], [9], [9, 10, 9, EOS], [7, 8, 9]])
def test_short_and_varied_answers_are_answers(ids: list[int]) -> None:
    assert agreement.degenerate(ids, EOS, PAD) is None


def test_a_lone_eos_is_an_answer_where_padding_is_eos() -> None:
    # SmolLM2's tokenizer pads with <|im_end|>, its EOS: an immediate stop is an empty answer, not padding.
    assert agreement.degenerate([EOS], EOS, EOS) is None
    assert agreement.degenerate([EOS, EOS], EOS, EOS) == f"only padding (1 x token id {EOS})"
