"""step_stats.p99: the 99th percentile across ranks (issue 5's min / median / max / p99)

Rolled up with the median from the same sort (``percentile_cont`` of both fractions at
once); rows rolled up before this migration have none.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("step_stats") as batch:
        batch.add_column(sa.Column("p99", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_stats") as batch:
        batch.drop_column("p99")
