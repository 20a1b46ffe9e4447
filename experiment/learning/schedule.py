"""The training schedule: the document positions of every update's global batch, one shuffled epoch that every arm
reads in the same order. Training follows it; the report checks every rank's journal against it (no torch)."""

from __future__ import annotations

import random

from experiment.core.plan import Plan


def schedule(plan: Plan) -> list[list[int]]:
    """Per update, the global batch's document positions: one shuffled epoch, identical for all arms."""
    order = list(range(plan.tasks.train + plan.tasks.replay))
    random.Random(plan.training.schedule_seed).shuffle(order)
    size = plan.training.documents_per_update
    return [order[u * size : (u + 1) * size] for u in range(plan.training.updates)]
