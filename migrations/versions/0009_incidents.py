"""incidents, their alerts and actions, and the operator logbook (notes)

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "incidents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("title", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("auto", sa.Integer(), nullable=False),
        sa.Column("opened_at", sa.Float(), nullable=False),
        sa.Column("opened_by", sa.String(length=128), nullable=False),
        sa.Column("closed_at", sa.Float(), nullable=True),
        sa.Column("closed_by", sa.String(length=128), nullable=True),
        sa.Column("summary", sa.String(length=2000), nullable=True),
        sa.Column("merged_into", sa.Integer(), nullable=True),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("nodes", sa.JSON(), nullable=False),
        sa.Column("history", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("posted_at", sa.Float(), nullable=True),
        sa.Column("post_status", sa.String(length=300), nullable=True),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_incidents_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_incidents")),
    )
    op.create_index(op.f("ix_incidents_run_id_opened_at"), "incidents", ["run_id", "opened_at"])
    op.create_index(op.f("ix_incidents_state"), "incidents", ["state"])
    op.create_table(
        "incident_items",
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("item_id", sa.Integer(), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=False),
        sa.Column("added_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["incident_id"],
            ["incidents.id"],
            name=op.f("fk_incident_items_incident_id_incidents"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("kind", "item_id", name=op.f("pk_incident_items")),
    )
    op.create_index(op.f("ix_incident_items_incident_id"), "incident_items", ["incident_id"])
    op.create_table(
        "notes",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("incident_id", sa.Integer(), nullable=True),
        sa.Column("author", sa.String(length=128), nullable=False),
        sa.Column("text", sa.String(length=10000), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_notes_run_id_runs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["incident_id"],
            ["incidents.id"],
            name=op.f("fk_notes_incident_id_incidents"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_notes")),
    )
    op.create_index(op.f("ix_notes_run_id_at"), "notes", ["run_id", "at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_notes_run_id_at"), table_name="notes")
    op.drop_table("notes")
    op.drop_index(op.f("ix_incident_items_incident_id"), table_name="incident_items")
    op.drop_table("incident_items")
    op.drop_index(op.f("ix_incidents_state"), table_name="incidents")
    op.drop_index(op.f("ix_incidents_run_id_opened_at"), table_name="incidents")
    op.drop_table("incidents")
