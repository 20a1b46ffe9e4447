"""gang formation deadline, evidence files, blobs on disk (answers and measurements get their order)

Revision ID: 3f9458f0a420
Revises: 7cd61f59c622
Create Date: 2026-11-29 22:52:53.229396
"""

from __future__ import annotations

import advanced_alchemy.types.datetime
import advanced_alchemy.types.guid
import sqlalchemy as sa
from alembic import op

revision = "3f9458f0a420"
down_revision = "7cd61f59c622"
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "evidence_files",
        sa.Column("id", advanced_alchemy.types.guid.GUID(length=16), nullable=False),
        sa.Column("experiment_id", advanced_alchemy.types.guid.GUID(length=16), nullable=False),
        sa.Column("attempt_id", advanced_alchemy.types.guid.GUID(length=16), nullable=True),
        sa.Column("path", sa.String(length=500), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("sa_orm_sentinel", sa.Integer(), nullable=True),
        sa.Column("created_at", advanced_alchemy.types.datetime.DateTimeUTC(timezone=True), nullable=False),
        sa.Column("updated_at", advanced_alchemy.types.datetime.DateTimeUTC(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"], ["attempts.id"], name=op.f("fk_evidence_files_attempt_id_attempts"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["experiment_id"],
            ["experiments.id"],
            name=op.f("fk_evidence_files_experiment_id_experiments"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(["sha256"], ["blobs.sha256"], name=op.f("fk_evidence_files_sha256_blobs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_evidence_files")),
        sa.UniqueConstraint("attempt_id", "path", name=op.f("uq_evidence_files_attempt_id")),
    )
    with op.batch_alter_table("evidence_files", schema=None) as batch_op:
        batch_op.create_index("ix_evidence_files_path", ["experiment_id", "path"], unique=False)

    with op.batch_alter_table("answers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("task_index", sa.Integer(), nullable=False))

    with op.batch_alter_table("blobs", schema=None) as batch_op:
        batch_op.drop_column("data")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("formation_deadline", advanced_alchemy.types.datetime.DateTimeUTC(timezone=True), nullable=True)
        )
        batch_op.add_column(sa.Column("formation_timeouts", sa.Integer(), server_default="0", nullable=False))

    with op.batch_alter_table("measurements", schema=None) as batch_op:
        batch_op.add_column(sa.Column("position", sa.Integer(), nullable=False))
        batch_op.create_unique_constraint(batch_op.f("uq_measurements_attempt_id"), ["attempt_id", "kind", "position"])


def downgrade() -> None:

    with op.batch_alter_table("measurements", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("uq_measurements_attempt_id"), type_="unique")
        batch_op.drop_column("position")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("formation_timeouts")
        batch_op.drop_column("formation_deadline")

    with op.batch_alter_table("blobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("data", sa.LargeBinary(), nullable=False))

    with op.batch_alter_table("answers", schema=None) as batch_op:
        batch_op.drop_column("task_index")

    with op.batch_alter_table("evidence_files", schema=None) as batch_op:
        batch_op.drop_index("ix_evidence_files_path")

    op.drop_table("evidence_files")
