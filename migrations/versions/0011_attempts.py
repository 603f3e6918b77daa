"""Run identity and attempts: one row per process lifetime of a run, one per process

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-09
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("config", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("tags", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("data_snapshot", sa.String(length=1000), nullable=True),
        sa.Column("code", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("env", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("packages_hash", sa.String(length=64), nullable=True),
        sa.Column("packages", sa.JSON(none_as_null=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_attempts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("run_id", "number", name=op.f("uq_attempts_run_id_number")),
    )
    op.create_index("ix_attempts_run_id_key", "attempts", ["run_id", "key"])
    op.create_table(
        "attempt_sessions",
        sa.Column("session", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=True),
        sa.Column("first_step_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.Column("last_seen", sa.Float(), nullable=True),
        sa.Column("last_step", sa.BigInteger(), nullable=True),
        sa.Column("last_step_end", sa.Float(), nullable=True),
        sa.Column("end_reason", sa.String(length=32), nullable=True),
        sa.Column("end_detail", sa.String(length=1000), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_attempt_sessions_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("session", name=op.f("pk_attempt_sessions")),
    )
    op.create_index("ix_attempt_sessions_run_id_attempt", "attempt_sessions", ["run_id", "attempt"])


def downgrade() -> None:
    op.drop_index("ix_attempt_sessions_run_id_attempt", table_name="attempt_sessions")
    op.drop_table("attempt_sessions")
    op.drop_index("ix_attempts_run_id_key", table_name="attempts")
    op.drop_table("attempts")
