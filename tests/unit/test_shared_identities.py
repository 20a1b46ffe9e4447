"""Identities the coordinator computes without loading torch must equal the ones experiment/ computes."""

from __future__ import annotations

import msgspec

from experiment.core.canonical import identity
from experiment.core.plan import load_plan, seed_identity
from experiment.learning.corpus import seed_snapshot
from tests.conftest import LOCAL_PLAN


def test_seed_identity_is_the_identity_of_the_seed_snapshot() -> None:
    plan = load_plan(LOCAL_PLAN)
    assert seed_identity(plan) == identity(msgspec.to_builtins(seed_snapshot(plan)))
