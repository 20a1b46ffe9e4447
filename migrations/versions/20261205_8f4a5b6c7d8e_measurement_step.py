"""measurement step: the update each step record or resource sample belongs to

Revision ID: 8f4a5b6c7d8e
Revises: 7e3f4a5b6c7d
Create Date: 2026-12-05 06:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "8f4a5b6c7d8e"
down_revision = "7e3f4a5b6c7d"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("measurements", schema=None) as batch_op:
        batch_op.add_column(sa.Column("step", sa.Integer(), nullable=True))
    # A journal entry's step is its position.
    op.execute("UPDATE measurements SET step = position WHERE kind = 'step'")


def downgrade() -> None:
    with op.batch_alter_table("measurements", schema=None) as batch_op:
        batch_op.drop_column("step")
