"""What the training's faults cost, from the coordinator's record of every training attempt (``attempts.json`` of
a coordinator's evidence bundle).

A train job runs in generations: every rank of a generation is one attempt, and a generation that did not succeed
(a rank lost, failed or cancelled) is followed by the next, which resumes from the last checkpoint its ranks hold.
Each such generation is a fault, and costs:

- **updates recomputed**: the updates the generation was heard to finish (its ranks' step events, as the
  coordinator accepted them before the generation ended) past the step the next started generation resumed from;
- **seconds lost**: the wall time from the generation's first claim to the next generation's first claim, less the
  seconds of the updates the next one kept (those the generation finished up to where the next resumed). It holds
  the detection (a lease expiring, a collective timing out), the recomputed updates and the generation's start."""

from __future__ import annotations

import datetime
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec

from experiment.core.errors import CoopError
from experiment.core.layout import ATTEMPTS
from experiment.core.states import JobState

Require = Callable[[bool, Path | str, str, str], None]
Count = Annotated[int, msgspec.Meta(ge=0)]


class StepHeard(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    step: Annotated[int, msgspec.Meta(ge=1)]
    seconds: Annotated[float, msgspec.Meta(ge=0)]


class TrainAttempt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank of one generation of an arm's train job, as the coordinator recorded it."""

    arm: str
    generation: Annotated[int, msgspec.Meta(ge=1)]
    rank: Count
    state: JobState  # never queued: an attempt begins leased
    reason: str | None
    claimed_at: Annotated[datetime.datetime, msgspec.Meta(tz=True)]
    resumed_from_step: Count | None  # its ``started`` event's; None: it never began to train
    steps: list[StepHeard]  # its ``step`` events, in order


class TrainingFault(msgspec.Struct, frozen=True):
    generation: int
    ended: list[str]  # each rank's end, by rank
    reason: str  # the first rank's reason, shortened
    reached_step: int  # the last update any of its ranks was heard to finish (its resumed step if none)
    resumed_from_step: int  # where the next started generation resumed
    updates_recomputed: int
    seconds_lost: float


REASON_CHARACTERS = 300


def read_attempts(bundle: Path) -> list[TrainAttempt] | None:
    """The bundle's training attempts; None when it carries none (a home's own bundle: no coordinator ran it)."""
    path = bundle / ATTEMPTS
    if not path.is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=list[TrainAttempt])
    except msgspec.DecodeError as exc:
        raise CoopError(f"{path}: attempts: is not a record of training attempts: {exc}") from exc


def _generations(attempts: list[TrainAttempt]) -> list[list[TrainAttempt]]:
    by_number: dict[int, list[TrainAttempt]] = defaultdict(list)
    for attempt in attempts:
        by_number[attempt.generation].append(attempt)
    return [sorted(by_number[n], key=lambda a: a.rank) for n in sorted(by_number)]


def _resumed(generation: list[TrainAttempt]) -> int | None:
    steps = {a.resumed_from_step for a in generation if a.resumed_from_step is not None}
    return max(steps) if steps else None


def arm_faults(
    path: Path, arm: str, attempts: list[TrainAttempt], final_resumed: list[int], updates: int, require: Require
) -> list[TrainingFault]:
    """The faults of ``arm``'s job. Its last generation succeeded on every rank, and where it began to train it
    resumed from the step each rank's own result says (``final_resumed``, by rank), or from the final update: the
    run had finished in an earlier generation, lost before it reported, and its result is that run's
    (experiment.learning.training reports it again, unchanged)."""
    generations = _generations([a for a in attempts if a.arm == arm])
    require(bool(generations), path, arm, "has no attempts")
    last = generations[-1]
    require(
        [a.state for a in last] == ["succeeded"] * len(final_resumed),
        path,
        f"{arm}.generation[{last[0].generation}]",
        "is not every rank succeeded",
    )
    for attempt, resumed in zip(last, final_resumed, strict=True):
        require(
            attempt.resumed_from_step in (None, resumed, updates),
            path,
            f"{arm}.generation[{attempt.generation}].rank[{attempt.rank}].resumed_from_step",
            f"is not the rank's result's ({resumed})",
        )
    faults = []
    for index, generation in enumerate(generations[:-1]):
        later = [_resumed(g) for g in generations[index + 1 :]]
        resumed = next((step for step in later if step is not None), final_resumed[0])
        own = _resumed(generation) or 0
        heard: dict[int, float] = {}
        for attempt in generation:
            for record in attempt.steps:
                heard[record.step] = max(heard.get(record.step, 0.0), record.seconds)
        reached = max(heard, default=own)
        kept = sum(seconds for step, seconds in heard.items() if step <= resumed)
        claimed = min(a.claimed_at for a in generation)
        next_claimed = min(a.claimed_at for a in generations[index + 1])
        first = next((a.reason for a in generation if a.reason), None) or ""
        faults.append(
            TrainingFault(
                generation=generation[0].generation,
                ended=[a.state for a in generation],
                reason=first[:REASON_CHARACTERS],
                reached_step=reached,
                resumed_from_step=resumed,
                updates_recomputed=max(0, reached - resumed),
                seconds_lost=round(max(0.0, (next_claimed - claimed).total_seconds() - kept), 3),
            )
        )
    return faults
