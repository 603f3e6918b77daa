"""ranks.high_step: the highest step ever stored for a rank

``last_step`` goes back with a rollback or a restart. Ingest took the steps past it as
new and let PostgreSQL's unique key catch a step stored already; but ``rank_steps`` is
partitioned by day, so a step run again after midnight UTC has a key of its own, and both
executions were kept. Steps up to ``high_step`` are now looked up, under any day. NULL
(rows from before this revision) reads as ``last_step``.

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ranks", sa.Column("high_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch:  # SQLite: a copy of the table
        batch.drop_column("high_step")
