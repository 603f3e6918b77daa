"""rollup_queue.seen_n and .newest: ingest counts a queued step's rows as it writes them

The rollup worker's frequent pass (every 0.25 s) found complete steps by counting
their rows in ``rank_steps``: when ingest falls behind, many steps are incomplete at
once and each pass counted all their rows again (at 8,192 ranks offered, the busiest
statement in PostgreSQL). Ingest now adds the rows each flush writes (``seen_n``) and
its time (``newest``); the worker's rarer recheck still counts the rows themselves.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rollup_queue") as batch:
        batch.add_column(sa.Column("seen_n", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("newest", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rollup_queue") as batch:
        batch.drop_column("newest")
        batch.drop_column("seen_n")
