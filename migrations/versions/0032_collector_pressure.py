"""collector_pressure: each collector's ingest pressure, read by the leader of a pass

A collector that refuses a request with 503 still counts its ranks as alive (the agent
names them in a header), and allows for its own delay before calling a rank dead. With
several collectors on one database (``serve --workers N``, or collectors behind a load
balancer) each knew only its own refusals, while the health and alert passes are led by
whichever collector takes the advisory lock: a rank whose requests another collector
refused could be called dead. Each collector now writes what it refused and when it fell
behind to this table, and the leader reads them all.

Revision ID: 0032
Revises: 0031
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "collector_pressure",
        sa.Column("collector", sa.String(length=128), nullable=False),
        sa.Column("behind_at", sa.Float(), nullable=True),
        sa.Column("lag_s", sa.Float(), nullable=False),
        sa.Column("heard", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("collector", name=op.f("pk_collector_pressure")),
    )


def downgrade() -> None:
    op.drop_table("collector_pressure")
