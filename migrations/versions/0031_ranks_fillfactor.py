"""ranks: half of each page left free (fillfactor 50), so a heartbeat's update stays on its page

Ingest updates every rank's row on every request (its heartbeat, last and highest step).
At PostgreSQL's default fillfactor (100) a page holds no room for the new version of a row:
nearly every update went to another page, with a new entry in the primary key's index, and
the table grew by a copy of itself a flush until a vacuum (measured: 16,384 ranks, 20
flushes, no vacuum between: 0.6 % of the updates HOT, the table 58 MB for 2 MB of live rows,
the flush's upsert 15.6 us a row). With half of each page free, the new version goes beside
the old one (a HOT update: no index entry, the old version pruned on the page): 99.6 % HOT,
6 MB, 9.9 us a row. New pages take the setting; rows already stored move as they are updated
and a vacuum frees their old pages.

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-28
"""

from __future__ import annotations

from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None

RANKS_FILLFACTOR = 50


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE ranks SET (fillfactor = {RANKS_FILLFACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE ranks RESET (fillfactor)")
