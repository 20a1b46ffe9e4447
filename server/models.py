"""The coordinator's tables. UUIDv7 keys and UTC audit timestamps come from advanced-alchemy.

Rows that record what happened (commitments, attempts, events, measurements, answers, audit) are
appended and never rewritten; ``state`` columns are the current summary, changed only by lifecycle.py.
"""

from __future__ import annotations

import datetime
import uuid
from enum import StrEnum

from advanced_alchemy.base import UUIDv7AuditBase
from advanced_alchemy.types.datetime import DateTimeUTC
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Enum,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    true,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from experiment.core.canonical import JsonObject
from experiment.core.states import ExperimentState, JobState
from experiment.wire import JobKind, Role, ServingPhaseName, TokenRole

Json = JsonObject


def _states(states: type[StrEnum]) -> Enum:
    """A state column: its values as VARCHAR(20), with a CHECK that the database holds no other."""
    return Enum(
        states,
        native_enum=False,
        length=20,
        create_constraint=True,
        name="state",
        values_callable=lambda members: [member.value for member in members],
        validate_strings=True,
    )


# advanced-alchemy's JsonB does not work with SQLAlchemy 2.1; this is the same idea: JSONB on Postgres.
JsonB = JSON().with_variant(JSONB(), "postgresql")


class Experiment(UUIDv7AuditBase):
    __tablename__ = "experiments"
    name: Mapped[str] = mapped_column(String(200))
    state: Mapped[ExperimentState] = mapped_column(_states(ExperimentState), index=True)
    plan_toml: Mapped[str] = mapped_column(Text)
    plan: Mapped[Json] = mapped_column(JsonB)
    plan_identity: Mapped[str] = mapped_column(String(64), index=True)
    prepared_identity: Mapped[str | None] = mapped_column(String(64), default=None)
    selection_identity: Mapped[str | None] = mapped_column(String(64), default=None)
    # Advance each phase as soon as the last one's jobs succeeded (the operator can switch it off).
    autopilot: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())


class Arm(UUIDv7AuditBase):
    __tablename__ = "arms"
    __table_args__ = (UniqueConstraint("experiment_id", "name"),)
    experiment_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(40))
    world_size: Mapped[int] = mapped_column(Integer)
    serving_eligible: Mapped[bool] = mapped_column(Boolean)
    final_step: Mapped[int | None] = mapped_column(Integer, default=None)
    model_identity: Mapped[str | None] = mapped_column(String(64), default=None)
    receipt_sha256: Mapped[str | None] = mapped_column(String(64), default=None)
    binding: Mapped[str | None] = mapped_column(String(64), default=None)
    # The final checkpoint's model folder, relative to the training host's experiment home.
    checkpoint_path: Mapped[str | None] = mapped_column(String(500), default=None)
    # The agent holding the final checkpoint (rank 0's host): evaluations and serving of the arm run there.
    holder_agent_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("agents.id"), default=None)


class Commitment(UUIDv7AuditBase):
    __tablename__ = "commitments"
    __table_args__ = (UniqueConstraint("experiment_id", "seq"),)
    experiment_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(20))
    identity: Mapped[str] = mapped_column(String(64))
    body: Mapped[Json] = mapped_column(JsonB)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))


class Agent(UUIDv7AuditBase):
    __tablename__ = "agents"
    name: Mapped[str] = mapped_column(String(200))
    token_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tokens.id"), unique=True)
    address: Mapped[str] = mapped_column(String(255))
    # The host's private interface's address, where its gangs meet (None: they meet at ``address``).
    private_address: Mapped[str | None] = mapped_column(String(45), default=None)
    labels: Mapped[Json] = mapped_column(JsonB)
    last_seen_at: Mapped[datetime.datetime] = mapped_column(DateTimeUTC(timezone=True))


class Job(UUIDv7AuditBase):
    __tablename__ = "jobs"
    # ix_jobs_state_queued: a claim reads a state's jobs oldest first (queue._claim_statement).
    __table_args__ = (
        Index("ix_jobs_state_world_size", "state", "world_size"),
        Index("ix_jobs_state_queued", "state", "queued_at", "id"),
    )
    experiment_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    kind: Mapped[JobKind] = mapped_column(String(20))
    arm: Mapped[str | None] = mapped_column(String(40), default=None)
    role: Mapped[Role | None] = mapped_column(String(10), default=None)
    spec: Mapped[Json] = mapped_column(JsonB)
    world_size: Mapped[int] = mapped_column(Integer)
    state: Mapped[JobState] = mapped_column(_states(JobState))
    # The attempt generation being filled or run; every rank of a gang shares it.
    attempts_made: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    # Ranks of the current generation not yet leased (a gang is leased one rank per claim).
    ranks_open: Mapped[int] = mapped_column(Integer)
    # Rendezvous of the current generation, fixed by the rank-0 claim.
    master_addr: Mapped[str | None] = mapped_column(String(255), default=None)
    master_port: Mapped[int | None] = mapped_column(Integer, default=None)
    cancel_requested_at: Mapped[datetime.datetime | None] = mapped_column(DateTimeUTC(timezone=True), default=None)
    # While a gang forms (rank 0 leased, other ranks open): when it is requeued if still incomplete.
    formation_deadline: Mapped[datetime.datetime | None] = mapped_column(DateTimeUTC(timezone=True), default=None)
    # Generations that ended because the gang never formed; they do not use up the retry budget.
    formation_timeouts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Only this agent may claim the job (for a gang: rank 0), because it holds the files the job needs.
    pinned_agent_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("agents.id"), default=None)
    # Ordering key for claims: first queued, first served.
    queued_at: Mapped[datetime.datetime] = mapped_column(DateTimeUTC(timezone=True))


class Attempt(UUIDv7AuditBase):
    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("job_id", "number", "rank"),
        Index("ix_attempts_state_lease", "state", "lease_expires_at"),
        # A claim's client key names one attempt of one agent: a retried claim finds it again.
        UniqueConstraint("agent_id", "claim_key"),
    )
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    # None: the coordinator's own attempt (the report job: server.reporter).
    agent_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("agents.id"), index=True, default=None)
    state: Mapped[JobState] = mapped_column(_states(JobState))
    lease_token_hash: Mapped[str] = mapped_column(String(64))
    claim_key: Mapped[str | None] = mapped_column(String(64), default=None)
    lease_expires_at: Mapped[datetime.datetime] = mapped_column(DateTimeUTC(timezone=True))
    master_addr: Mapped[str | None] = mapped_column(String(255), default=None)
    master_port: Mapped[int | None] = mapped_column(Integer, default=None)
    cancel_deadline: Mapped[datetime.datetime | None] = mapped_column(DateTimeUTC(timezone=True), default=None)
    exit_code: Mapped[int | None] = mapped_column(Integer, default=None)
    reason: Mapped[str | None] = mapped_column(Text, default=None)
    result: Mapped[Json | None] = mapped_column(JsonB, default=None)
    finished_at: Mapped[datetime.datetime | None] = mapped_column(DateTimeUTC(timezone=True), default=None)


class Event(UUIDv7AuditBase):
    """The audit trail of the science and of every state change (kind ``state`` for the latter)."""

    __tablename__ = "events"
    experiment_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("experiments.id", ondelete="CASCADE"), index=True, default=None
    )
    job_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), default=None)
    attempt_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("attempts.id", ondelete="CASCADE"), index=True, default=None
    )
    sequence: Mapped[int | None] = mapped_column(BigInteger, default=None)
    kind: Mapped[str] = mapped_column(String(100))
    at: Mapped[datetime.datetime] = mapped_column(DateTimeUTC(timezone=True))
    body: Mapped[Json] = mapped_column(JsonB)


class Measurement(UUIDv7AuditBase):
    """A step journal entry or resource sample: recorded from the attempt's events while it runs, and from its
    result those the events did not carry."""

    __tablename__ = "measurements"
    __table_args__ = (UniqueConstraint("attempt_id", "kind", "position"),)
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(40))
    # Order within the attempt and kind: the journal's step, the sample's index.
    position: Mapped[int] = mapped_column(Integer)
    # The update it belongs to: a journal entry's own, the one a sample was taken in (None when not known).
    step: Mapped[int | None] = mapped_column(Integer, default=None)
    at: Mapped[datetime.datetime] = mapped_column(DateTimeUTC(timezone=True))
    body: Mapped[Json] = mapped_column(JsonB)


class Answer(UUIDv7AuditBase):
    """One evaluated answer: the protocol publishes every final-test answer."""

    __tablename__ = "answers"
    __table_args__ = (
        UniqueConstraint("experiment_id", "arm", "role", "task_id"),
        Index("ix_answers_filter", "experiment_id", "arm", "role", "family", "variant", "correct"),
    )
    experiment_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"))
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    arm: Mapped[str] = mapped_column(String(40))
    role: Mapped[Role] = mapped_column(String(10))
    task_id: Mapped[str] = mapped_column(String(64))
    # The task's index in its role (the order answers are listed in).
    task_index: Mapped[int] = mapped_column(Integer)
    family: Mapped[str] = mapped_column(String(20))
    variant: Mapped[int] = mapped_column(Integer)
    correct: Mapped[bool] = mapped_column(Boolean)
    body: Mapped[Json] = mapped_column(JsonB)


class ServingResult(UUIDv7AuditBase):
    __tablename__ = "serving_results"
    experiment_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), index=True)
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    phase: Mapped[ServingPhaseName] = mapped_column(String(20))
    body: Mapped[Json] = mapped_column(JsonB)


class Blob(UUIDv7AuditBase):
    """Evidence stored by content (prepared bundle files, run results, answers, reports); the bytes live in
    ``COOP_HOME/blobs`` as one file per sha256, written once."""

    __tablename__ = "blobs"
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    size: Mapped[int] = mapped_column(BigInteger)
    media_type: Mapped[str] = mapped_column(String(100))


class AttemptUpload(UUIDv7AuditBase):
    """A blob an agent uploaded as evidence of one of its attempts, one row an upload: the attempt's evidence quota
    (Plan.evidence_quota) is the sum of their sizes."""

    __tablename__ = "attempt_uploads"
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"), index=True)
    sha256: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)


class EvidenceFile(UUIDv7AuditBase):
    """One file of an experiment's evidence bundle: its path in the bundle and the blob that holds it."""

    __tablename__ = "evidence_files"
    # A path may be written again by a retry of the same job; the export takes the generation that succeeded.
    __table_args__ = (UniqueConstraint("attempt_id", "path"), Index("ix_evidence_files_path", "experiment_id", "path"))
    experiment_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"))
    # The attempt whose result named it; None when the operator attached it (e.g. selection.json).
    attempt_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"), default=None)
    path: Mapped[str] = mapped_column(String(500))
    sha256: Mapped[str] = mapped_column(ForeignKey("blobs.sha256"))


class Token(UUIDv7AuditBase):
    """A bearer token; only its sha256 is kept, the secret is printed once."""

    __tablename__ = "tokens"
    name: Mapped[str] = mapped_column(String(200), unique=True)
    role: Mapped[TokenRole] = mapped_column(String(20))
    secret_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    revoked_at: Mapped[datetime.datetime | None] = mapped_column(DateTimeUTC(timezone=True), default=None)


class WebSession(UUIDv7AuditBase):
    """A browser signed in with a token: its cookie names this row, which ends at ``expires_at`` (an absolute
    lifetime, never extended), at sign-out (``ended_at``), or with its token's revocation."""

    __tablename__ = "web_sessions"
    token_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tokens.id", ondelete="CASCADE"), index=True)
    expires_at: Mapped[datetime.datetime] = mapped_column(DateTimeUTC(timezone=True))
    ended_at: Mapped[datetime.datetime | None] = mapped_column(DateTimeUTC(timezone=True), default=None)


class IdempotentRequest(UUIDv7AuditBase):
    """The stored response of an upload, so that a replay with the same key gets the same answer."""

    __tablename__ = "idempotent_requests"
    key: Mapped[str] = mapped_column(String(300), unique=True)
    request_sha256: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int] = mapped_column(Integer)
    response: Mapped[bytes] = mapped_column(LargeBinary)


class AuditLog(UUIDv7AuditBase):
    __tablename__ = "audit_log"
    token_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("tokens.id"), default=None, index=True)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(100))
    target: Mapped[str] = mapped_column(String(300))
    detail: Mapped[Json] = mapped_column(JsonB)
