"""bucket_maxima: a heatmap bucket's per-rank maxima as one row a bucket

Migration 0005's ``rank_buckets`` kept a row a rank and bucket: the step-time heatmap of a
1,024-rank run over 10,000 steps read and grouped 159,744 rows (0.13-0.20 s of its 0.25-0.45 s,
bench/results/query-cpu-2vcpu.txt). ``bucket_maxima`` keeps a bucket's maxima of every rank
in one row, ``ranks[i]``'s in ``maxima[i]`` in rank order (arrays on PostgreSQL, JSON lists
on SQLite). The stored maxima are carried over.

Revision ID: 0029
Revises: 0028
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "bucket_maxima",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(length=32), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column(
            "ranks",
            sa.JSON().with_variant(postgresql.ARRAY(sa.Integer()), "postgresql"),
            nullable=False,
        ),
        sa.Column(
            "maxima",
            sa.JSON().with_variant(postgresql.ARRAY(sa.Float()), "postgresql"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_bucket_maxima_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(
            "run_id", "metric", "level", "bucket", name=op.f("pk_bucket_maxima")
        ),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "INSERT INTO bucket_maxima (run_id, metric, level, bucket, ranks, maxima) "
            "SELECT run_id, metric, level, bucket, array_agg(rank ORDER BY rank), "
            "array_agg(max ORDER BY rank) FROM rank_buckets GROUP BY run_id, metric, level, bucket"
        )
    else:  # json_group_array takes the rows in the order the subquery gives them
        op.execute(
            "INSERT INTO bucket_maxima (run_id, metric, level, bucket, ranks, maxima) "
            "SELECT run_id, metric, level, bucket, json_group_array(rank), "
            "json_group_array(json(printf('%!.17g', max))) "
            "FROM (SELECT * FROM rank_buckets ORDER BY run_id, metric, level, bucket, rank) "
            "GROUP BY run_id, metric, level, bucket"
        )
    op.drop_table("rank_buckets")


def downgrade() -> None:
    op.create_table(
        "rank_buckets",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(length=32), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.BigInteger(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("max", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rank_buckets_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(
            "run_id", "metric", "level", "bucket", "rank", name=op.f("pk_rank_buckets")
        ),
    )
    op.drop_table("bucket_maxima")
