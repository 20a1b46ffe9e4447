"""The names of a home's and an evidence bundle's files and folders (docs/evidence.md), in one place: the
experiment's commands, the agents and the coordinator spell them from here. Constants and string functions
only, so that an agent imports them without loading torch."""

from __future__ import annotations

PREPARED = "prepared"  # the prepared inputs: role files, plan.json and manifest.json
MANIFEST = "manifest.json"  # in PREPARED; its identity is the prepared identity
PLAN = "plan.json"  # in PREPARED: the frozen plan
SELECTION = "selection.json"  # the committed selection, at the top
SEED = "seed"  # in a bundle: the seed's small files (tokenizer, template, config); never its weights
EVALUATIONS = "evaluations"  # evaluations/ROLE/ARM: evaluation.json, answers.jsonl, retention.jsonl
RUNS = "runs"  # runs/ARM/rank-R: a training rank's run.json, result.json and checkpoints
RUN_EVIDENCE = ("result.json", "run.json")  # what of a rank's folder goes into the bundle (never weights)
SERVING = "serving"  # serving/PHASE.json: one benchmark phase's record
LEDGER = "ledger.json"  # at the top of a bundle: the commitment ledger
ATTEMPTS = "attempts.json"  # at the top of a coordinator's bundle: every training attempt (experiment.report.attempts)


def evaluation(role: str, arm: str) -> str:
    """An evaluation's folder, relative to a home or a bundle."""
    return f"{EVALUATIONS}/{role}/{arm}"


def arm_runs(arm: str) -> str:
    """The folder of an arm's ranks, relative to a home or a bundle."""
    return f"{RUNS}/{arm}"


def run(arm: str, rank: int) -> str:
    """One training rank's folder, relative to a home or a bundle."""
    return f"{arm_runs(arm)}/rank-{rank}"


def serving_phase(phase: str) -> str:
    """One benchmark phase's record, relative to a bundle."""
    return f"{SERVING}/{phase}.json"
