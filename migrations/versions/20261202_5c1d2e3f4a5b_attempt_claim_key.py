"""attempt claim key

Revision ID: 5c1d2e3f4a5b
Revises: aabf5490d303
Create Date: 2026-12-02 09:45:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "5c1d2e3f4a5b"
down_revision = "aabf5490d303"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("claim_key", sa.String(length=64), nullable=True))
        batch_op.create_unique_constraint(batch_op.f("uq_attempts_agent_id"), ["agent_id", "claim_key"])


def downgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_attempts_agent_id"), type_="unique")
        batch_op.drop_column("claim_key")
