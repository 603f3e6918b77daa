"""agent_commands.action_id may be empty: requests for the ranks' collectives

When a rank hangs, the health evaluator (or an operator) asks every rank of the run for
its Flight Recorder ring with a ``collectives`` command. It rides on the ingest answer
like an action's commands, but belongs to no action.

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("agent_commands") as batch:  # SQLite: a copy of the table
        batch.alter_column("action_id", existing_type=sa.Integer(), nullable=True)


def downgrade() -> None:
    op.execute("DELETE FROM agent_commands WHERE action_id IS NULL")
    with op.batch_alter_table("agent_commands") as batch:
        batch.alter_column("action_id", existing_type=sa.Integer(), nullable=False)
