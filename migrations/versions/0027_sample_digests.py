"""sample_digests: which samples each rank trained on, as a digest per step

On a step where the trainer called ``s.samples(ids)``, each rank sends an order-sensitive
64-bit digest of its sample ids and their count (agent/samples.py). The health evaluator
finds a batch that several ranks of one data-parallel group trained on.

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sample_digests",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("recv_ts", sa.Float(), nullable=False),
        sa.Column("digest", sa.String(length=16), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("first_digest", sa.String(length=16), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_sample_digests_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "step", "rank", name=op.f("pk_sample_digests")),
    )
    op.create_index(
        op.f("ix_sample_digests_run_id_recv_ts"), "sample_digests", ["run_id", "recv_ts"]
    )


def downgrade() -> None:
    op.drop_table("sample_digests")
