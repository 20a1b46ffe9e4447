"""Rows as wire Structs: the one place that turns a model into what the API returns."""

from __future__ import annotations

from typing import Any

from experiment import wire
from server import models


def experiment(row: models.Experiment) -> wire.Experiment:
    return wire.Experiment(
        id=row.id,
        name=row.name,
        state=row.state,  # type: ignore[arg-type]
        plan_identity=row.plan_identity,
        prepared_identity=row.prepared_identity,
        selection_identity=row.selection_identity,
        autopilot=row.autopilot,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def arm(row: models.Arm) -> wire.Arm:
    return wire.Arm(
        id=row.id,
        experiment_id=row.experiment_id,
        name=row.name,
        world_size=row.world_size,
        serving_eligible=row.serving_eligible,
        final_step=row.final_step,
        model_identity=row.model_identity,
        receipt_sha256=row.receipt_sha256,
    )


def job(row: models.Job) -> wire.Job:
    return wire.Job(
        id=row.id,
        experiment_id=row.experiment_id,
        kind=row.kind,  # type: ignore[arg-type]
        arm=row.arm,
        role=row.role,  # type: ignore[arg-type]
        world_size=row.world_size,
        state=row.state,  # type: ignore[arg-type]
        attempts_made=row.attempts_made,
        max_attempts=row.max_attempts,
        spec=row.spec,
        pinned_agent_id=row.pinned_agent_id,
        created_at=row.created_at,
    )


def attempt(row: models.Attempt) -> wire.Attempt:
    return wire.Attempt(
        id=row.id,
        job_id=row.job_id,
        number=row.number,
        rank=row.rank,
        agent_id=row.agent_id,
        state=row.state,  # type: ignore[arg-type]
        lease_expires_at=row.lease_expires_at,
        master_addr=row.master_addr,
        master_port=row.master_port,
        cancel_deadline=row.cancel_deadline,
        exit_code=row.exit_code,
        reason=row.reason,
        created_at=row.created_at,
    )


def agent(row: models.Agent) -> wire.Agent:
    labels: dict[str, Any] = row.labels
    return wire.Agent(
        id=row.id,
        name=row.name,
        address=row.address,
        private_address=row.private_address,
        labels={str(k): str(v) for k, v in labels.items()},
        last_seen_at=row.last_seen_at,
        created_at=row.created_at,
    )


def event(row: models.Event) -> wire.RecordedEvent:
    return wire.RecordedEvent(
        id=row.id,
        experiment_id=row.experiment_id,
        job_id=row.job_id,
        attempt_id=row.attempt_id,
        sequence=row.sequence,
        kind=row.kind,
        at=row.at,
        body=row.body,
    )
