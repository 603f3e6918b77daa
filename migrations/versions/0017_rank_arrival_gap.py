"""ranks.arrival_gap_s: seconds between a rank's last two requests, as they arrived

The health evaluator declares a rank dead after ``dead_after_beats`` heartbeats of
silence. A collector past its capacity spaces every rank's requests out (they wait to be
read, or are refused with 503 and retried), and live ranks went silent that long: at 6x
overload it called 27,000 live ranks dead in 40 s. Ingest now records each rank's gap
between arrivals; the evaluator widens its thresholds by how much later than their
heartbeat the live ranks of the run actually arrive.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ranks", sa.Column("arrival_gap_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ranks") as batch:  # SQLite: a copy of the table
        batch.drop_column("arrival_gap_s")
