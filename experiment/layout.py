"""The names of a home's and an evidence bundle's files and folders (docs/evidence.md), in one place: the
experiment's commands, the agents and the coordinator spell them from here. Constants only, so that an agent
imports them without loading torch."""

from __future__ import annotations

PREPARED = "prepared"  # the prepared inputs: role files, plan.json and manifest.json
MANIFEST = "manifest.json"  # in PREPARED; its identity is the prepared identity
PLAN = "plan.json"  # in PREPARED: the frozen plan
SELECTION = "selection.json"  # the committed selection, at the top
SEED = "seed"  # in a bundle: the seed's small files (tokenizer, template, config); never its weights
EVALUATIONS = "evaluations"  # evaluations/ROLE/ARM: evaluation.json, answers.jsonl, retention.jsonl


def evaluation(role: str, arm: str) -> str:
    """An evaluation's folder, relative to a home or a bundle."""
    return f"{EVALUATIONS}/{role}/{arm}"
