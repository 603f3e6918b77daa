"""rank_steps and gpu_samples without a foreign key to runs: the check cost half of each insert

A row of ``rank_steps`` per rank per step is the collector's hot path: PostgreSQL checked
the foreign key to ``runs`` row by row, an RI trigger per inserted row (100,000 rows: 1.0 s
with it, 0.5 s without). Ingest writes the run row before its ranks' rows in the same
transaction, nothing deletes runs, and ``db prune`` drops these tables' days whole; the
rollups, events and the rest keep their keys.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TABLES = ("rank_steps", "gpu_samples")


def upgrade() -> None:
    for table in TABLES:
        if op.get_bind().dialect.name == "sqlite":
            # SQLite rebuilds a table to drop a constraint; keep the partial index.
            with op.batch_alter_table(table, recreate="always") as batch:
                batch.drop_constraint(f"fk_{table}_run_id_runs", type_="foreignkey")
        else:  # on the partitioned parent: its partitions follow
            op.drop_constraint(f"fk_{table}_run_id_runs", table, type_="foreignkey")


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.create_foreign_key(
                f"fk_{table}_run_id_runs", "runs", ["run_id"], ["id"], ondelete="CASCADE"
            )
