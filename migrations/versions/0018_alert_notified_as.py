"""alerts.notified_as: the fingerprint an alert was last notified under

More than ``group_over`` alerts of one rule and run are paged as one notification (a
storm: a node or a whole job gone). Its members fire and resolve over several passes,
and each must be resolved under the fingerprint it was paged under: its own, or its
group's. Without this, a group whose last members resolved a few at a time was never
resolved (in PagerDuty, an incident left open), and an alert paged alone but resolved
with a group was resolved under a fingerprint never paged.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("alerts", sa.Column("notified_as", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("alerts") as batch:  # SQLite: a copy of the table
        batch.drop_column("notified_as")
