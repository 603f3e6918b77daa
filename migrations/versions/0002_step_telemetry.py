"""step telemetry: phases, communication split, MFU, grad norm, spike flags, memory

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

FLOATS = [
    "fwd_s",
    "bwd_s",
    "opt_s",
    "other_s",
    "compute_s",
    "exposed_comm_s",
    "overlapped_comm_s",
    "idle_s",
    "grad_norm",
    "flops",
    "mfu",
    "peak_flops",
]
INTS = ["mem_allocated_bytes", "mem_reserved_bytes", "rss_bytes"]


def upgrade() -> None:
    with op.batch_alter_table("rank_steps") as batch:
        for name in FLOATS:
            batch.add_column(sa.Column(name, sa.Float(), nullable=True))
        batch.add_column(sa.Column("comm_source", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("flops_source", sa.String(length=128), nullable=True))
        batch.add_column(sa.Column("peak_source", sa.String(length=255), nullable=True))
        for name in INTS:
            batch.add_column(sa.Column(name, sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("flags", sa.JSON(), nullable=True))
    op.create_index(
        "ix_rank_steps_flagged",
        "rank_steps",
        ["run_id", "step"],
        postgresql_where=sa.text("flags IS NOT NULL"),
        sqlite_where=sa.text("flags IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_rank_steps_flagged", table_name="rank_steps")
    with op.batch_alter_table("rank_steps") as batch:
        for name in [*FLOATS, "comm_source", "flops_source", "peak_source", *INTS, "flags"]:
            batch.drop_column(name)
