"""The events a `coop` command prints that its agent, or the coordinator, acts on: each command's final event and
the failure phase's call to stop a replica, one Struct each, named by its ``event`` tag. The command prints
``msgspec.to_builtins`` of one; the agent decodes the last line of that name into it. Light (msgspec only): the
agent imports it without torch."""

from __future__ import annotations

import msgspec

from experiment.learning.records import Candidate, NumericalProfile, ResourceSample, StepRecord


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


# A training rank's progress, as `coop train` prints it while it runs: the coordinator keeps each as an event of the
# attempt, and its pages draw them (server/store/measurements.py, server/web/progress.py).


class StartedEvent(CommandEvent, tag="started", frozen=True):
    """`coop train` bound a rank's run and resumed it: from the seed (``resumed_from_step`` 0) or a checkpoint."""

    arm: str
    rank: int
    world_size: int
    binding: str
    numerical_profile: NumericalProfile
    resumed_from_step: int
    updates: int


class StepEvent(StepRecord, frozen=True, kw_only=True, tag_field="event", tag="step"):
    """An update of a rank's run ended: its journal entry, with how far the run is (``done`` of ``total``) and, for
    a DiLoCo worker, the outer steps so far (null for an arm that synchronizes every update)."""

    arm: str
    rank: int
    done: int
    total: int
    outer_steps: int | None = None


class ResourcesEvent(ResourceSample, frozen=True, kw_only=True, tag_field="event", tag="resources"):
    """A resource sample of a rank's process, the ``index``-th of its run, taken during update ``step``."""

    arm: str
    rank: int
    step: int
    index: int


class CheckpointEvent(CommandEvent, tag="checkpoint", frozen=True):
    """A rank saved its checkpoint of ``step`` (``written`` "checkpoint"), or confirmed the one an earlier attempt
    left (``written`` names how)."""

    arm: str
    rank: int
    step: int
    checkpoint: str
    parameter_digest: str
    written: str


class StoppedEvent(CommandEvent, tag="stopped", frozen=True):
    """A run told to stop after update ``step`` (``--stop-after``) stopped there, unfinished."""

    arm: str
    rank: int
    step: int


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
