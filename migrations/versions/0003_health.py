"""health: heartbeats and rank state; GPU samples

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

RANK_COLUMNS = [
    sa.Column("heartbeat_s", sa.Float(), nullable=True),
    sa.Column("progress_at", sa.Float(), nullable=True),
    sa.Column("in_step", sa.Integer(), nullable=True),
    sa.Column("phase", sa.String(length=32), nullable=True),
    sa.Column("state_since", sa.Float(), nullable=True),
    sa.Column("state_detail", sa.JSON(), nullable=True),
    sa.Column("clock_skew_s", sa.Float(), nullable=True),
    sa.Column("gpu", sa.JSON(), nullable=True),
]


def upgrade() -> None:
    with op.batch_alter_table("ranks") as batch:
        for column in RANK_COLUMNS:
            batch.add_column(column)
    floats = [
        "temp_c",
        "mem_temp_c",
        "power_w",
        "power_limit_w",
        "sm_clock_mhz",
        "sm_clock_max_mhz",
        "util_gpu",
        "util_mem",
    ]
    ints = [
        "mem_used_bytes",
        "mem_total_bytes",
        "ecc_corrected",
        "ecc_uncorrected",
        "retired_pages",
        "remapped_rows_correctable",
        "remapped_rows_uncorrectable",
        "pcie_replay",
    ]
    op.create_table(
        "gpu_samples",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("recv_ts", sa.Float(), nullable=False),
        sa.Column("gpu_uuid", sa.String(length=64), nullable=True),
        sa.Column("gpu_name", sa.String(length=128), nullable=True),
        *[sa.Column(name, sa.Float(), nullable=True) for name in floats],
        sa.Column("throttle", sa.JSON(), nullable=True),
        *[sa.Column(name, sa.BigInteger(), nullable=True) for name in ints],
        sa.Column("remap_pending", sa.Integer(), nullable=True),
        sa.Column("recovery_action", sa.String(length=32), nullable=True),
        sa.Column("simulated", sa.Integer(), server_default="0", nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_gpu_samples_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "rank", "ts", name=op.f("pk_gpu_samples")),
    )


def downgrade() -> None:
    op.drop_table("gpu_samples")
    with op.batch_alter_table("ranks") as batch:
        for column in RANK_COLUMNS:
            batch.drop_column(column.name)
