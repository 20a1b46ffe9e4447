"""autopilot, job pinning, arm checkpoint holder

Revision ID: aabf5490d303
Revises: 3f9458f0a420
Create Date: 2026-11-30 00:28:40.108181
"""

from __future__ import annotations

import advanced_alchemy.types.datetime
import advanced_alchemy.types.guid
import sqlalchemy as sa
from alembic import op

revision = "aabf5490d303"
down_revision = "3f9458f0a420"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("arms", schema=None) as batch_op:
        batch_op.add_column(sa.Column("binding", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("checkpoint_path", sa.String(length=500), nullable=True))
        batch_op.add_column(sa.Column("holder_agent_id", advanced_alchemy.types.guid.GUID(length=16), nullable=True))
        batch_op.create_foreign_key(batch_op.f("fk_arms_holder_agent_id_agents"), "agents", ["holder_agent_id"], ["id"])

    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.add_column(sa.Column("autopilot", sa.Boolean(), server_default=sa.true(), nullable=False))

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pinned_agent_id", advanced_alchemy.types.guid.GUID(length=16), nullable=True))
        batch_op.create_foreign_key(batch_op.f("fk_jobs_pinned_agent_id_agents"), "agents", ["pinned_agent_id"], ["id"])


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_jobs_pinned_agent_id_agents"), type_="foreignkey")
        batch_op.drop_column("pinned_agent_id")

    with op.batch_alter_table("experiments", schema=None) as batch_op:
        batch_op.drop_column("autopilot")

    with op.batch_alter_table("arms", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_arms_holder_agent_id_agents"), type_="foreignkey")
        batch_op.drop_column("holder_agent_id")
        batch_op.drop_column("checkpoint_path")
        batch_op.drop_column("binding")
