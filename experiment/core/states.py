"""The states of an experiment and of a job (and of one attempt at it), defined once: the coordinator's
columns, its transition table (server/dispatch/lifecycle.py), the wire and the report all take them from here."""

from __future__ import annotations

from enum import StrEnum


class ExperimentState(StrEnum):
    """An experiment's place in the protocol; the coordinator's transition table is server/dispatch/lifecycle.py."""

    DRAFT = "draft"
    COMMITTED = "committed"
    PREPARED = "prepared"
    TRAINING = "training"
    TRAINED = "trained"
    SELECTED = "selected"
    TESTED = "tested"
    SERVING = "serving"
    REPORTED = "reported"
    FAILED = "failed"
    HALTED = "halted"


class JobState(StrEnum):
    """A job's state, and an attempt's (an attempt is never queued)."""

    QUEUED = "queued"
    LEASED = "leased"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"
    CANCELLED = "cancelled"
