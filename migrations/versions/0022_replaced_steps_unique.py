"""replaced_steps: each replaced execution once

Two collectors that take the same replayed batch at the same moment (or one flush that
holds a retried batch twice) could each keep the execution it replaces, and the
replaced series counted it twice. Duplicates are removed, and a unique index on the
execution (run, rank, step, its start time) keeps it once from now on.

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DELETE FROM replaced_steps a USING replaced_steps b WHERE a.ctid > b.ctid "
            "AND a.run_id = b.run_id AND a.rank = b.rank AND a.step = b.step AND a.ts = b.ts"
        )
    else:
        op.execute(
            "DELETE FROM replaced_steps WHERE rowid NOT IN "
            "(SELECT min(rowid) FROM replaced_steps GROUP BY run_id, rank, step, ts)"
        )
    op.create_index(
        "ux_replaced_steps_execution",
        "replaced_steps",
        ["run_id", "rank", "step", "ts"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index("ux_replaced_steps_execution", table_name="replaced_steps")
