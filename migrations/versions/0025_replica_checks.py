"""replica_checks, replica_results: silent data corruption found by replica fingerprints

In data parallelism every replica holds bit-identical parameters after each optimizer
step. On a checked step each rank sends a fingerprint of its parameters and its replica
group; the health evaluator compares them within each group and keeps the result.

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "replica_checks",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("recv_ts", sa.Float(), nullable=False),
        sa.Column("replica_group", sa.String(length=1024), nullable=False),
        sa.Column("fingerprint", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_replica_checks_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "rank", name=op.f("pk_replica_checks")),
    )
    op.create_index(
        op.f("ix_replica_checks_run_id_recv_ts"), "replica_checks", ["run_id", "recv_ts"]
    )
    op.create_table(
        "replica_results",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("replica_group", sa.String(length=1024), nullable=False),
        sa.Column("decided_at", sa.Float(), nullable=False),
        sa.Column("agree", sa.Boolean(), nullable=False),
        sa.Column("suspects", sa.JSON(), nullable=False),
        sa.Column("missing", sa.JSON(), nullable=False),
        sa.Column("fingerprints", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_replica_results_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "replica_group", name=op.f("pk_replica_results")),
    )


def downgrade() -> None:
    op.drop_table("replica_results")
    op.drop_table("replica_checks")
