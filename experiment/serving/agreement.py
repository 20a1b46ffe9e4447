"""Served answers against the evaluation of the same checkpoint: the check a replica passes before it serves
anything, and the report's serving check (docs/evidence.md).

The evaluation's greedy answers are the truth a replica must reproduce. On a CPU (fp32, one sequence at a time)
the output ids must be equal. GPU kernels may round a last bit differently, so there the strict-check outcomes
must agree and the token agreement is recorded. A completion made of one repeated token, or of padding only, is
refused whatever the evaluation says: that is a broken model, not an answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from experiment.core import tasks
from experiment.learning.records import Answer


class ServedAnswer(msgspec.Struct, frozen=True):
    """What a replica answered to one task, through the probe: the ids and the strict checker's outcome."""

    task_id: str
    output_ids: list[int]
    check: tasks.Check


class Agreement(msgspec.Struct, frozen=True):
    tasks: int
    identical: int  # answers whose output ids equal the evaluation's
    same_outcome: int  # answers whose strict-check outcome equals the evaluation's
    matched_tokens: int  # the evaluation's output tokens reproduced before the first differing token
    expected_tokens: int  # the evaluation's output tokens
    correct: int  # served answers the strict checker accepts
    expected_correct: int  # the evaluation's correct answers on the same tasks
    first_difference: str | None  # the first task whose ids differ, and where
    first_other_outcome: str | None  # the first task whose strict-check outcome differs
    token_agreement: float  # matched_tokens / expected_tokens (1 when nothing was expected)


def degenerate(output_ids: Sequence[int], eos_id: int, pad_id: int) -> str | None:
    """Why a completion is no answer at all, or None: only padding, or one token repeated (a terminating EOS
    aside; a lone EOS is an empty answer, which the strict checker judges)."""
    body = list(output_ids[:-1] if output_ids and output_ids[-1] == eos_id else output_ids)
    if body and all(token == pad_id for token in body):
        return f"only padding ({len(body)} x token id {pad_id})"
    if len(body) > 1 and len(set(body)) == 1:
        return f"one token repeated ({len(body)} x token id {body[0]})"
    return None


def _first_difference(expected: Sequence[int], served: Sequence[int]) -> int | None:
    for position, (a, b) in enumerate(zip(expected, served, strict=False)):
        if a != b:
            return position
    return None if len(expected) == len(served) else min(len(expected), len(served))


def compare(expected: Mapping[str, Answer], served: Sequence[ServedAnswer]) -> Agreement:
    """How far ``served`` reproduces the evaluation's answers to the same tasks (every task must be evaluated)."""
    identical = same_outcome = matched = total = 0
    first: str | None = None
    first_outcome: str | None = None
    for answer in served:
        truth = expected[answer.task_id]
        position = _first_difference(truth.output_ids, answer.output_ids)
        total += len(truth.output_ids)
        matched += len(truth.output_ids) if position is None else position
        identical += position is None
        same_outcome += answer.check == truth.check
        if answer.check != truth.check and first_outcome is None:
            first_outcome = (
                f"task {answer.task_id} (dev index {truth.index}): served {answer.check.reason}, "
                f"evaluated {truth.check.reason}"
            )
        if position is not None and first is None:
            window = slice(position, position + 4)
            first = (
                f"task {answer.task_id} (dev index {truth.index}) differs at output token {position}: "
                f"served {answer.output_ids[window]}, evaluated {truth.output_ids[window]}"
            )
    return Agreement(
        tasks=len(served),
        identical=identical,
        same_outcome=same_outcome,
        matched_tokens=matched,
        expected_tokens=total,
        correct=sum(a.check.correct for a in served),
        expected_correct=sum(expected[a.task_id].check.correct for a in served),
        first_difference=first,
        first_other_outcome=first_outcome,
        token_agreement=matched / total if total else 1.0,
    )


def refusal(agreement: Agreement, device: str, min_same_outcome: float = 1.0) -> str | None:
    """Why served answers are not the evaluated model's, or None. CPU: every answer's ids equal. GPU: at least
    ``min_same_outcome`` of the strict-check outcomes equal (the ids' agreement is recorded, not required)."""
    if device == "cpu":
        if agreement.identical < agreement.tasks:
            return (
                f"{agreement.tasks - agreement.identical} of {agreement.tasks} answers differ from the evaluation's "
                f"output ids; the first: {agreement.first_difference}"
            )
        return None
    if agreement.same_outcome < min_same_outcome * agreement.tasks:
        return (
            f"{agreement.same_outcome} of {agreement.tasks} strict-check outcomes equal the evaluation's "
            f"(at least {min_same_outcome:.0%} must); the first that differs: {agreement.first_other_outcome}"
        )
    return None
