"""alerts.onset_step: where the anomaly began in the data

A rollback chose its checkpoint by the step at which the alert engine first saw the
condition; with fast steps and a pass every ~2 s that is dozens of steps after the loss
left its trend, so it could restore a checkpoint saved after the spiked update. This
keeps the first step of the condition's streak (a baseline or threshold rule) or the
earliest matching record's step (an event rule).

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("alerts", sa.Column("onset_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("alerts") as batch:  # SQLite: a copy of the table
        batch.drop_column("onset_step")
