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


def test_identical_answers_agree_on_every_token() -> None:
    served = [agreement.ServedAnswer(a.id, a.output_ids, a.check) for a in EXPECTED.values()]
    result = agreement.compare(EXPECTED, served)
    assert (result.tasks, result.identical, result.same_outcome) == (2, 2, 2)
    assert (result.matched_tokens, result.expected_tokens, result.token_agreement) == (7, 7, 1.0)
    assert (result.correct, result.expected_correct) == (1, 1)
    assert agreement.refusal(result, "cpu") is None
    assert agreement.refusal(result, "cuda") is None


def test_one_differing_token_is_refused_on_cpu_and_named() -> None:
    served = [
        agreement.ServedAnswer("t0", [7, 8, 4, EOS], RIGHT),  # the same outcome, another third token
        agreement.ServedAnswer("t1", [7, 3, EOS], WRONG),
    ]
    result = agreement.compare(EXPECTED, served)
    assert (result.identical, result.same_outcome, result.matched_tokens) == (1, 2, 2 + 3)
    assert result.token_agreement == pytest.approx(5 / 7)
    refused = agreement.refusal(result, "cpu")
    assert refused is not None
    assert "1 of 2 answers differ" in refused and "task t0 (dev index 0) differs at output token 2" in refused
    # On a GPU ids may differ in a last bit; the strict-check outcomes decide.
    assert agreement.refusal(result, "cuda") is None


def test_another_outcome_is_refused_on_gpu_below_the_threshold() -> None:
    served = [
        agreement.ServedAnswer("t0", [7, 8, 9, EOS], RIGHT),
        agreement.ServedAnswer("t1", [7, 4, EOS], RIGHT),  # served right where the evaluation was wrong
    ]
    result = agreement.compare(EXPECTED, served)
    assert (result.same_outcome, result.correct, result.expected_correct) == (1, 2, 1)
    refused = agreement.refusal(result, "cuda")
    assert refused is not None and "1 of 2 strict-check outcomes" in refused
    assert "task t1 (dev index 1): served correct, evaluated wrong_schema_or_value" in refused
    assert agreement.refusal(result, "cuda", min_same_outcome=0.5) is None


def test_a_shorter_answer_differs_where_it_ends() -> None:
    result = agreement.compare(EXPECTED, [agreement.ServedAnswer("t0", [7, 8], WRONG)])
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
