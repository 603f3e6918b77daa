"""replaced_steps: the executions of a step that a later one replaced

A rollback or a restart runs steps again, and ``rank_steps`` keeps only the latest
execution of each (run, rank, step). The replaced ones were the interesting ones (the
loss spike a rollback went back from): their loss, grad norm, step time, flags and
issues are now kept here, for the overview and the post-mortem.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replaced_steps",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("day", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("replaced_at", sa.Float(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("grad_norm", sa.Float(), nullable=True),
        sa.Column("flags", sa.JSON(), nullable=True),
        sa.Column("issues", sa.JSON(), nullable=True),
    )
    op.create_index("ix_replaced_steps_run_step", "replaced_steps", ["run_id", "step"])


def downgrade() -> None:
    op.drop_index("ix_replaced_steps_run_step", table_name="replaced_steps")
    op.drop_table("replaced_steps")
