"""step_lr: the learning rate, a built-in metric of each step (``rank_steps.lr``)

The trainer gives it with ``s.lr(value)`` (the Hugging Face, Lightning and Accelerate
integrations do); it is rolled up across ranks as the series ``lr``. Before, the
integrations sent it as the user metric ``lr`` (``user.lr``), which runs recorded then
keep. On PostgreSQL the column is added to the partitioned parent and so to every day's
partition, without a rewrite (a NULL default).

Revision ID: 0033
Revises: 0032
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("rank_steps", sa.Column("lr", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rank_steps") as batch:
        batch.drop_column("lr")
