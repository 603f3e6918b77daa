"""day partitions: rank_steps and gpu_samples keyed by the record's UTC day, partitioned
by it on PostgreSQL so that old raw data drops whole (``trainwarden db prune``)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-21

Each table is rebuilt: the old one is renamed, the new one created (partitioned on
PostgreSQL, with one partition per day present in the data), the rows copied with
their day, and the old table dropped.
"""

from __future__ import annotations

import datetime as dt

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

DAY_S = 86400
KEYS = {
    "rank_steps": ["run_id", "step", "rank", "day"],
    "gpu_samples": ["run_id", "rank", "ts", "day"],
}


def _partition(table: str, day: int) -> str:
    date = dt.datetime.fromtimestamp(day * DAY_S, tz=dt.timezone.utc)
    return f"{table}_p{date:%Y%m%d}"


def _rebuild(table: str) -> None:
    bind = op.get_bind()
    postgres = bind.dialect.name == "postgresql"
    old = f"{table}_old"
    if table == "rank_steps":
        op.drop_index("ix_rank_steps_flagged", table_name=table)
    if postgres:  # index-backed constraint names are unique per schema: free this one
        op.execute(f"ALTER TABLE {table} RENAME CONSTRAINT pk_{table} TO pk_{table}_old")
    op.rename_table(table, old)
    columns = [
        sa.Column(
            c["name"],
            c["type"],
            nullable=c["nullable"],
            server_default=None if c.get("default") is None else sa.text(c["default"]),
        )
        for c in sa.inspect(bind).get_columns(old)
        if c["name"] != "day"
    ]
    names = [c.name for c in columns]
    columns.insert(3, sa.Column("day", sa.Integer(), nullable=False))  # after the key columns
    op.create_table(
        table,
        *columns,
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f(f"fk_{table}_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint(*KEYS[table], name=op.f(f"pk_{table}")),
        **({"postgresql_partition_by": "RANGE (day)"} if postgres else {}),
    )
    day_expr = "CAST(floor(ts / 86400) AS INTEGER)" if postgres else "CAST(ts / 86400 AS INTEGER)"
    if postgres:
        days = bind.execute(sa.text(f"SELECT DISTINCT {day_expr} FROM {old}")).scalars().all()
        for day in days:
            op.execute(
                f"CREATE TABLE {_partition(table, day)} PARTITION OF {table} "
                f"FOR VALUES FROM ({day}) TO ({day + 1})"
            )
    cols = ", ".join(names)
    op.execute(f"INSERT INTO {table} ({cols}, day) SELECT {cols}, {day_expr} FROM {old}")
    op.drop_table(old)
    if table == "rank_steps":
        op.create_index(
            "ix_rank_steps_flagged",
            table,
            ["run_id", "step"],
            postgresql_where=sa.text("flags IS NOT NULL"),
            sqlite_where=sa.text("flags IS NOT NULL"),
        )


def upgrade() -> None:
    _rebuild("rank_steps")
    _rebuild("gpu_samples")


def downgrade() -> None:
    raise NotImplementedError("0006 cannot be undone: restore a backup taken before it")
