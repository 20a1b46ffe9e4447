"""attempt uploads: each blob an agent uploads as an attempt's evidence, one row an upload, for its quota

Revision ID: cd8e9fa0b1c2
Revises: bc7d8e9fa0b1
Create Date: 2026-12-07 12:00:00.000000
"""

from __future__ import annotations

import advanced_alchemy.types.datetime
import advanced_alchemy.types.guid
import sqlalchemy as sa
from alembic import op

revision = "cd8e9fa0b1c2"
down_revision = "bc7d8e9fa0b1"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "attempt_uploads",
        sa.Column("id", advanced_alchemy.types.guid.GUID(length=16), nullable=False),
        sa.Column("attempt_id", advanced_alchemy.types.guid.GUID(length=16), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sa_orm_sentinel", sa.Integer(), nullable=True),
        sa.Column("created_at", advanced_alchemy.types.datetime.DateTimeUTC(timezone=True), nullable=False),
        sa.Column("updated_at", advanced_alchemy.types.datetime.DateTimeUTC(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_attempt_uploads_attempt_id_attempts"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempt_uploads")),
    )
    with op.batch_alter_table("attempt_uploads", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_attempt_uploads_attempt_id"), ["attempt_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("attempt_uploads", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_attempt_uploads_attempt_id"))
    op.drop_table("attempt_uploads")
