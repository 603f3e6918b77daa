"""actions: rollbacks, evictions and stops with their history; commands to ranks

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "actions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("trigger", sa.String(length=128), nullable=False),
        sa.Column("alert_id", sa.Integer(), nullable=True),
        sa.Column("fingerprint", sa.String(length=64), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("approver", sa.String(length=128), nullable=True),
        sa.Column("plan", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("reason", sa.String(length=2000), nullable=True),
        sa.Column("history", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("finished_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_actions_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_actions")),
    )
    op.create_index(op.f("ix_actions_state"), "actions", ["state"])
    op.create_index(op.f("ix_actions_run_id_created_at"), "actions", ["run_id", "created_at"])
    op.create_index(op.f("ix_actions_fingerprint"), "actions", ["fingerprint"])
    op.create_table(
        "agent_commands",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("action_id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("delivered_at", sa.Float(), nullable=True),
        sa.Column("done_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["action_id"],
            ["actions.id"],
            name=op.f("fk_agent_commands_action_id_actions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_agent_commands_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agent_commands")),
    )
    op.create_index(op.f("ix_agent_commands_run_id_rank"), "agent_commands", ["run_id", "rank"])


def downgrade() -> None:
    op.drop_index(op.f("ix_agent_commands_run_id_rank"), table_name="agent_commands")
    op.drop_table("agent_commands")
    op.drop_index(op.f("ix_actions_fingerprint"), table_name="actions")
    op.drop_index(op.f("ix_actions_run_id_created_at"), table_name="actions")
    op.drop_index(op.f("ix_actions_state"), table_name="actions")
    op.drop_table("actions")
