"""alerts: episodes with their lifecycle, delivery attempts, silences

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("fingerprint", sa.String(length=32), nullable=False),
        sa.Column("rule", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("node", sa.String(length=255), nullable=True),
        sa.Column("gpu", sa.String(length=64), nullable=True),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("labels", sa.JSON(), nullable=False),
        sa.Column("annotations", sa.JSON(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("action", sa.String(length=16), server_default="none", nullable=False),
        sa.Column("active_since", sa.Float(), nullable=False),
        sa.Column("active_since_step", sa.BigInteger(), nullable=True),
        sa.Column("fired_at", sa.Float(), nullable=True),
        sa.Column("cleared_at", sa.Float(), nullable=True),
        sa.Column("cleared_at_step", sa.BigInteger(), nullable=True),
        sa.Column("resolved_at", sa.Float(), nullable=True),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("acked_at", sa.Float(), nullable=True),
        sa.Column("acked_by", sa.String(length=128), nullable=True),
        sa.Column("ack_comment", sa.String(length=1000), nullable=True),
        sa.Column("silenced_by", sa.Integer(), nullable=True),
        sa.Column("inhibited_by", sa.Integer(), nullable=True),
        sa.Column("notified", sa.String(length=16), nullable=True),
        sa.Column("last_sent_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_alerts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
    )
    op.create_index(op.f("ix_alerts_state"), "alerts", ["state"])
    op.create_index(op.f("ix_alerts_run_id_active_since"), "alerts", ["run_id", "active_since"])
    op.create_index(op.f("ix_alerts_fingerprint"), "alerts", ["fingerprint"])
    op.create_table(
        "alert_deliveries",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("alert_id", sa.Integer(), nullable=False),
        sa.Column("receiver", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("ok", sa.Integer(), nullable=False),
        sa.Column("http_status", sa.Integer(), nullable=True),
        sa.Column("error", sa.String(length=1000), nullable=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("final", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["alert_id"],
            ["alerts.id"],
            name=op.f("fk_alert_deliveries_alert_id_alerts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alert_deliveries")),
    )
    op.create_index(op.f("ix_alert_deliveries_alert_id"), "alert_deliveries", ["alert_id"])
    op.create_table(
        "silences",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("matchers", sa.JSON(), nullable=False),
        sa.Column("starts_at", sa.Float(), nullable=False),
        sa.Column("ends_at", sa.Float(), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("comment", sa.String(length=1000), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_silences")),
    )


def downgrade() -> None:
    op.drop_table("silences")
    op.drop_index(op.f("ix_alert_deliveries_alert_id"), table_name="alert_deliveries")
    op.drop_table("alert_deliveries")
    op.drop_index(op.f("ix_alerts_fingerprint"), table_name="alerts")
    op.drop_index(op.f("ix_alerts_run_id_active_since"), table_name="alerts")
    op.drop_index(op.f("ix_alerts_state"), table_name="alerts")
    op.drop_table("alerts")
