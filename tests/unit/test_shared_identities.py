"""Identities the coordinator computes without loading torch must equal the ones experiment/ computes."""

from __future__ import annotations

import msgspec

from experiment import wire
from experiment.canonical import identity
from experiment.corpus import seed_snapshot
from experiment.plan import load_plan, seed_identity
from experiment.records import Candidate
from tests.conftest import LOCAL_PLAN


def test_select_result_carries_exactly_the_fields_of_a_selection_candidate() -> None:
    assert wire.SelectResult.__struct_fields__ == Candidate.__struct_fields__


def test_seed_identity_is_the_identity_of_the_seed_snapshot() -> None:
    plan = load_plan(LOCAL_PLAN)
    assert seed_identity(plan) == identity(msgspec.to_builtins(seed_snapshot(plan)))
