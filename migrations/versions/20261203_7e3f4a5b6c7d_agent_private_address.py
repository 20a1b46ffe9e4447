"""agent private address: where a host's gangs meet, on its private interface

Revision ID: 7e3f4a5b6c7d
Revises: 6d2e3f4a5b6c
Create Date: 2026-12-03 16:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "7e3f4a5b6c7d"
down_revision = "6d2e3f4a5b6c"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("agents", schema=None) as batch_op:
        batch_op.add_column(sa.Column("private_address", sa.String(length=45), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("agents", schema=None) as batch_op:
        batch_op.drop_column("private_address")
