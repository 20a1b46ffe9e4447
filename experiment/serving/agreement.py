"""Served answers against the evaluation of the same checkpoint: the check a replica passes before it serves
anything, and the report's serving check (docs/evidence.md).

The evaluation's greedy answers are the truth a replica must reproduce, by one rule (``refusal``) that the probe's
start gate and the report's serving check both apply, stated with its reasons in docs/protocol.md:
- on a CPU (fp32, one sequence at a time) the output ids must be equal, on every task;
- on a GPU, vLLM's kernels are not transformers' (batch invariance makes vLLM agree with itself at any batch size,
  not with another library), so a near-tie may end greedy decoding on another token: at most one strict-check
  outcome in ``GPU_TASKS_PER_DIFFERENCE`` may differ, and the token agreement is recorded. The probe asks
  ``identity_tasks(device)`` dev tasks, enough on a GPU for the rule to tolerate two.
A completion made of one repeated token, or of padding only, is refused whatever the evaluation says: that is a
broken model, not an answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from experiment.core import tasks
from experiment.learning.records import Answer

CPU_IDENTITY_TASKS = 8  # on a CPU the ids must be equal: both wordings of every family show a wrong stack
GPU_IDENTITY_TASKS = 32  # on a GPU: the serving workload's size, where the rule tolerates two differing outcomes
GPU_TASKS_PER_DIFFERENCE = 16  # on a GPU, one strict-check outcome in 16 may differ from the evaluation's


def identity_tasks(device: str) -> int:
    """How many dev tasks a replica answers as evaluated before it serves anything."""
    return CPU_IDENTITY_TASKS if device == "cpu" else GPU_IDENTITY_TASKS


def allowed_differences(tasks: int, device: str) -> int:
    """How many of ``tasks`` answers may differ from the evaluation's: none on a CPU (ids), one in 16 on a GPU
    (strict-check outcomes)."""
    return 0 if device == "cpu" else tasks // GPU_TASKS_PER_DIFFERENCE


class ServedAnswer(msgspec.Struct, frozen=True):
    """What a replica answered to one task, through the probe: the ids, their text and the strict checker's
    outcome."""

    task_id: str
    output_ids: list[int]
    text: str
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


def _side_by_side(truth: Answer, answer: ServedAnswer) -> str:
    position = _first_difference(truth.output_ids, answer.output_ids)
    where = "" if position is None else f" from output token {position}"
    return (
        f"task {answer.task_id} (dev index {truth.index}){where}: "
        f"served {answer.text[:160]!r} ({answer.check.reason}) | evaluated {truth.text[:160]!r} ({truth.check.reason})"
    )


def refusal(expected: Mapping[str, Answer], served: Sequence[ServedAnswer], device: str) -> str | None:
    """Why served answers are not the evaluated model's, or None: the one rule (module docstring). A refusal names
    every differing task, the served answer beside the evaluated one, one task a line."""
    result = compare(expected, served)
    if device == "cpu":
        differing = [a for a in served if a.output_ids != expected[a.task_id].output_ids]
        what = "answers differ from the evaluation's output ids"
    else:
        differing = [a for a in served if a.check != expected[a.task_id].check]
        what = "strict-check outcomes differ from the evaluation's"
    allowed = allowed_differences(result.tasks, device)
    if len(differing) <= allowed:
        return None
    lines = [_side_by_side(expected[a.task_id], a) for a in differing]
    return "\n".join([f"{len(differing)} of {result.tasks} {what} (at most {allowed} may on {device}):", *lines])
