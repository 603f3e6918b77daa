"""node_clearances: a node marked repaired (``trainwarden nodes clear``)

A node's record across runs is read from what already implicates it (alerts with a
``finding`` label, evictions, hang culprits, crash loops: ``collector/read/nodes.py``);
this table holds only when an operator said it was repaired, by whom and why: the
findings before that no longer count against it.

Revision ID: 0034
Revises: 0033
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_clearances",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("node", sa.String(length=255), nullable=False),
        sa.Column("cleared_at", sa.Float(), nullable=False),
        sa.Column("by", sa.String(length=128), nullable=False),
        sa.Column("note", sa.String(length=2000), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_node_clearances")),
    )
    op.create_index("ix_node_clearances_node", "node_clearances", ["node", "cleared_at"])


def downgrade() -> None:
    op.drop_index("ix_node_clearances_node", table_name="node_clearances")
    op.drop_table("node_clearances")
