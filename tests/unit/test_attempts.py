"""What the training's faults cost, from a record of attempts whose costs are worked out by hand below."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from experiment.core.errors import CoopError
from experiment.report.attempts import StepHeard, TrainAttempt, arm_faults

T0 = datetime.datetime(2026, 12, 3, 12, 0, tzinfo=datetime.UTC)
WHERE = Path("attempts.json")
UPDATES = 8  # the record's run: generation 3 trains to update 8


def require(condition: bool, where: Path | str, field: str, problem: str) -> None:
    if not condition:
        raise CoopError(f"{where}: {field}: {problem}")


def attempt(
    generation: int, rank: int, state: str, after: float, resumed: int | None, steps: range = range(0)
) -> TrainAttempt:
    return TrainAttempt(
        arm="clean-pair",
        generation=generation,
        rank=rank,
        state=state,  # type: ignore[arg-type]
        reason=f"generation {generation} rank {rank} {state}" if state != "succeeded" else None,
        claimed_at=T0 + datetime.timedelta(seconds=after),
        resumed_from_step=resumed,
        steps=[StepHeard(s, 1.0 + 0.5 * rank) for s in steps],
    )


RECORD = [
    # Generation 1 trains from the seed; rank 1 is heard to reach update 5, rank 0 update 3, and it is lost.
    attempt(1, 0, "cancelled", 0.0, 0, range(1, 4)),
    attempt(1, 1, "lost", 2.0, 0, range(1, 6)),
    # Generation 2 is lost before it trains (its rendezvous failed).
    attempt(2, 0, "lost", 20.0, None),
    attempt(2, 1, "cancelled", 21.0, None),
    # Generation 3 resumes from the checkpoint at update 4 and succeeds.
    attempt(3, 0, "succeeded", 30.0, 4, range(5, 9)),
    attempt(3, 1, "succeeded", 30.5, 4, range(5, 9)),
]


def test_each_generation_that_did_not_succeed_costs_its_updates_past_the_resume_and_its_unkept_time() -> None:
    first, second = arm_faults(WHERE, "clean-pair", RECORD, [4, 4], UPDATES, require)
    # Heard to reach 5, and the next generation that trained resumed from 4: one update recomputed. From the first
    # claim (0 s) to the next generation's first (20 s), less the kept updates 1-4 at their slower rank's 1.5 s.
    assert (first.generation, first.ended, first.reached_step, first.resumed_from_step) == (
        1,
        ["cancelled", "lost"],
        5,
        4,
    )
    assert (first.updates_recomputed, first.seconds_lost) == (1, 20.0 - 4 * 1.5)
    assert first.reason == "generation 1 rank 0 cancelled"
    # Generation 2 computed nothing: its whole span (20 s to 30 s) is lost, and no update was recomputed.
    assert (second.generation, second.reached_step, second.updates_recomputed, second.seconds_lost) == (2, 0, 0, 10.0)


def test_an_arm_that_succeeded_at_once_has_no_faults() -> None:
    assert arm_faults(WHERE, "clean-pair", RECORD[-2:], [4, 4], UPDATES, require) == []


def test_the_record_must_end_where_the_ranks_own_results_say() -> None:
    with pytest.raises(CoopError, match=r"generation\[3\]\.rank\[1\]\.resumed_from_step: is not the rank's result's"):
        arm_faults(WHERE, "clean-pair", RECORD, [4, 0], UPDATES, require)
    with pytest.raises(CoopError, match=r"clean-pair.generation\[2\]: is not every rank succeeded"):
        arm_faults(WHERE, "clean-pair", RECORD[:4], [4, 4], UPDATES, require)
    with pytest.raises(CoopError, match="clean-pair: has no attempts"):
        arm_faults(WHERE, "clean-pair", [], [4, 4], UPDATES, require)


def test_a_run_that_finished_in_a_lost_generation_is_reported_again_from_its_final_update() -> None:
    """Generation 1 trained all 8 updates (heard to 6) but was lost before it reported; generation 2 resumed from
    the final checkpoint, and its result is generation 1's (resumed from 0): nothing was recomputed."""
    record = [
        attempt(1, 0, "lost", 0.0, 0, range(1, 7)),
        attempt(2, 0, "succeeded", 30.0, UPDATES),
    ]
    (fault,) = arm_faults(WHERE, "clean-pair", record, [0], UPDATES, require)
    assert (fault.reached_step, fault.resumed_from_step, fault.updates_recomputed) == (6, UPDATES, 0)
    assert fault.seconds_lost == 30.0 - 6 * 1.0
    with pytest.raises(CoopError, match="is not the rank's result's"):
        arm_faults(WHERE, "clean-pair", [record[0], attempt(2, 0, "succeeded", 30.0, 5)], [0], UPDATES, require)
