"""jobs by state in claim order: the claim reads the oldest claimable job of a state from the index and stops there

Revision ID: ab6c7d8e9fa0
Revises: 9a5b6c7d8e9f
Create Date: 2026-12-06 04:30:00.000000
"""

from __future__ import annotations

from alembic import op

revision = "ab6c7d8e9fa0"
down_revision = "9a5b6c7d8e9f"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_state_queued", ["state", "queued_at", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_state_queued")
