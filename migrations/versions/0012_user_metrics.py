"""User metrics: rank_steps.metrics (JSONB on PostgreSQL), step_stats.metric widened

``s.metric(name, value)`` values ride in each step row as ``{name: value}``; their
rollups are ``step_stats`` rows named ``user.<name>`` (up to 5 + 32 characters). On
PostgreSQL ``rank_steps`` is partitioned by day: a column added to the parent is added
to every partition; widening a varchar rewrites nothing.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_METRICS = sa.JSON(none_as_null=True).with_variant(
    postgresql.JSONB(none_as_null=True), "postgresql"
)


def upgrade() -> None:
    with op.batch_alter_table("rank_steps") as batch:
        batch.add_column(sa.Column("metrics", _METRICS, nullable=True))
    with op.batch_alter_table("step_stats") as batch:
        batch.alter_column(
            "metric",
            existing_type=sa.String(length=32),
            type_=sa.String(length=48),
            existing_nullable=False,
        )


def downgrade() -> None:
    op.execute("DELETE FROM step_stats WHERE metric LIKE 'user.%'")
    with op.batch_alter_table("step_stats") as batch:
        batch.alter_column(
            "metric",
            existing_type=sa.String(length=48),
            type_=sa.String(length=32),
            existing_nullable=False,
        )
    with op.batch_alter_table("rank_steps") as batch:
        batch.drop_column("metrics")
