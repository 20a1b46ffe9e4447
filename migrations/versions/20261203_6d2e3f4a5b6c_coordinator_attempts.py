"""coordinator attempts: an attempt without an agent is the coordinator's own (the report job)

Revision ID: 6d2e3f4a5b6c
Revises: 5c1d2e3f4a5b
Create Date: 2026-12-03 09:00:00.000000
"""

from __future__ import annotations

import advanced_alchemy.types.guid
from alembic import op

revision = "6d2e3f4a5b6c"
down_revision = "5c1d2e3f4a5b"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.alter_column("agent_id", existing_type=advanced_alchemy.types.guid.GUID(length=16), nullable=True)


def downgrade() -> None:
    # The coordinator's own attempts have no agent to give them: they go, with what hangs off them.
    op.execute("DELETE FROM attempts WHERE agent_id IS NULL")
    with op.batch_alter_table("attempts", schema=None) as batch_op:
        batch_op.alter_column("agent_id", existing_type=advanced_alchemy.types.guid.GUID(length=16), nullable=False)
