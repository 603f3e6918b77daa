"""alerts.fired_at_step: the run's step when an alert fired

The timeline and the post-mortem showed a firing alert at its ``step``, which each pass
moves on to the newest step the condition held at: an alert that fired at step 618 and
held until step 888 read "firing, step 888". This keeps the step it fired at: the
condition's step in the pass that fired it (an XID's own step), else the run's.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("alerts", sa.Column("fired_at_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("alerts") as batch:  # SQLite: a copy of the table
        batch.drop_column("fired_at_step")
