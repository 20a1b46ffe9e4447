"""The protocol's table (server/protocol/table.py) is whole and agrees with the parts that act on it: its rows follow
the state machine's forward transitions in order, every commitment that enters a state is made by a row, a job
kind's success or an operator, every commitment a row makes from jobs or by advancing has its recording, and the
stages a row queues are the jobs of kinds the coordinator knows. How an experiment moves by it, against a real
coordinator and database, is tests/integration/coordinator/test_phases.py's."""

from __future__ import annotations

import itertools

import pytest

from experiment.core.plan import load_plan
from experiment.core.states import ExperimentState
from server.dispatch.lifecycle import EXPERIMENT_FINAL, EXPERIMENT_TRANSITIONS
from server.protocol import kinds, recording, table
from tests.support import ROOT

E = ExperimentState
# Commitments made outside the table's rows: the plan by the operator's commit of a draft (phases.commit), the
# prepared inputs and the report by the success of their job kinds (kinds.TABLE's settle).
MADE_BY_A_KIND = {"prepared": "prepare", "report": "report"}


def test_the_rows_are_the_state_machines_forward_path_in_order() -> None:
    states = [row.state for row in table.TABLE]
    assert states[0] == E.DRAFT and states[-1] == E.REPORTED
    for before, after in itertools.pairwise(states):
        assert after in EXPERIMENT_TRANSITIONS[before], (before, after)
    # Every state off the table is one an experiment only ends in.
    assert set(ExperimentState) - set(states) <= set(EXPERIMENT_FINAL)


def test_every_commitment_that_enters_a_state_is_made_and_recorded() -> None:
    entering = {row.entered.commitment for row in table.TABLE if isinstance(row.entered, table.Committed)}
    made = {row.makes.commitment for row in table.TABLE if row.makes is not None}
    assert entering == made | set(MADE_BY_A_KIND)
    for commitment, kind in MADE_BY_A_KIND.items():
        assert kinds.of(kind).settle is not None, commitment
    by_advancing_or_jobs = made - {"plan"}
    assert set(recording.MAKERS) == by_advancing_or_jobs
    assert {
        row.entered.commitment: row.state for row in table.TABLE if isinstance(row.entered, table.Committed)
    } == table.ENTERS


@pytest.mark.parametrize("plan_name", ["local.toml", "local-diloco.toml"])
def test_each_row_queues_known_kinds_and_a_commitment_made_from_jobs_names_jobs_it_queues(plan_name: str) -> None:
    plan = load_plan(ROOT / "plans" / plan_name)
    for row in table.TABLE:
        orders = [order for stage in table.stages(plan, row.state) for order in stage]
        assert all(order.kind in kinds.TABLE for order in orders), row.state
        made = table.makes(plan, row.state)
        if made is not None and made.kind is not None:
            assert any((order.kind, order.role) == (made.kind, made.role) for order in orders), row.state
    # The local-SGD design serves no arm: it is reported once tested, and makes no serving commitment.
    tested = table.stages(plan, E.TESTED)
    assert (tested == [[table.REPORT]]) != plan.serves()
    assert (table.makes(plan, E.TESTED) is None) != plan.serves()
