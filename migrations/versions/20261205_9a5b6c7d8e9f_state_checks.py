"""state checks: experiments, jobs and attempts hold only the states the protocol names

Revision ID: 9a5b6c7d8e9f
Revises: 8f4a5b6c7d8e
Create Date: 2026-12-05 18:30:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "9a5b6c7d8e9f"
down_revision = "8f4a5b6c7d8e"
branch_labels = None
depends_on = None

EXPERIMENT_STATES = (
    "draft",
    "committed",
    "prepared",
    "training",
    "trained",
    "selected",
    "tested",
    "serving",
    "reported",
    "failed",
    "halted",
)
JOB_STATES = ("queued", "leased", "running", "succeeded", "failed", "lost", "cancelled")
CHECKED = {"experiments": EXPERIMENT_STATES, "jobs": JOB_STATES, "attempts": JOB_STATES}


def upgrade() -> None:
    for table, states in CHECKED.items():
        allowed = ", ".join(f"'{state}'" for state in states)
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_check_constraint(op.f(f"ck_{table}_state"), f"state IN ({allowed})")


def downgrade() -> None:
    for table in reversed(CHECKED):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(f"ck_{table}_state"), type_="check")
