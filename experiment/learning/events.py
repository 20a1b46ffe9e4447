"""The events a `coop` command prints that its agent, or the coordinator, acts on: each command's final event and
the failure phase's call to stop a replica, one Struct each, named by its ``event`` tag. The command prints
``msgspec.to_builtins`` of one; the agent decodes the last line of that name into it. Light (msgspec only): the
agent imports it without torch."""

from __future__ import annotations

import msgspec

from experiment.learning.records import Candidate


class CommandEvent(msgspec.Struct, frozen=True, tag_field="event"):
    """A JSON line a command prints, its name in the ``event`` field (the agent's wire.Event kind)."""


def name_of(event: type[CommandEvent]) -> str:
    """The ``event`` field of a line of this type."""
    return str(event.__struct_config__.tag)


class PreparedEvent(CommandEvent, tag="prepared", frozen=True):
    """`coop prepare` wrote the prepared inputs; their identity is what the coordinator commits."""

    prepared_identity: str
    plan_identity: str
    home: str
    train_documents: int
    grounded: int
    replay: int
    damaged: int
    dev: int
    test: int
    retention: int
    weighted_targets: int
    grounded_weight_share: float


class CompletedEvent(CommandEvent, tag="completed", frozen=True):
    """`coop train` ran a rank's last update; ``result`` is its result file (records.Result)."""

    arm: str
    rank: int
    parameter_digest: str
    loop_seconds: float
    result: str


class EvaluatedEvent(CommandEvent, tag="evaluated", frozen=True):
    """`coop evaluate` answered every task; ``evaluation`` is its summary file (records.Summary), answers.jsonl
    beside it."""

    arm: str
    role: str
    answers: int
    correct: int
    accuracy: float
    retention_mean_nats: float
    evaluation: str


class VerifiedEvent(CommandEvent, tag="verified", frozen=True):
    """`coop checkpoint verify` verified an arm's final checkpoint on this host."""

    candidate: Candidate


class BenchmarkedEvent(CommandEvent, tag="benchmarked", frozen=True):
    """`coop benchmark` ran a phase; ``output`` is its record (serving.servingrecord.PhaseResult). The line also
    carries the phase's metrics, which are read from the record."""

    phase: str
    output: str


class StopReplicaEvent(CommandEvent, tag="stop-replica", frozen=True):
    """The failure phase's benchmark asks the coordinator to stop a replica, after ``completed`` completions."""

    phase: str
    completed: int


Figure = int | float | str | bool


class CanaryStep(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One step of `coop canary` on one host: what it measured, and, where it failed, why and what fixes it."""

    name: str
    passed: bool
    seconds: float
    figures: dict[str, Figure] = {}
    failure: str | None = None
    fix: str | None = None


class CanariedEvent(CommandEvent, tag="canaried", frozen=True):
    """`coop canary` ran its steps on this host (rank ``rank`` of its gang): passed only if every step did. A step
    that failed ends the canary there; the steps after it are not run."""

    rank: int
    world_size: int
    passed: bool
    steps: list[CanaryStep]
