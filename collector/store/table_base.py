"""What every table module shares: the one ``MetaData`` (and its naming convention) that
each table is declared on, and the partitioning of the per-rank raw tables.

The whole schema is ``models.metadata``, this same object once ``models`` has imported
every table module: take it from there (migrations, ``create_all``), not from here.
"""

from __future__ import annotations

from sqlalchemy import MetaData

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

# Per-rank raw data is partitioned by day on PostgreSQL (migration 0006) so that
# `trainwarden db prune --keep-raw` drops old days whole. ``day`` is the UTC day of
# the record's own timestamp: a replayed record lands on the same key.
PARTITION_BY = "RANGE (day)"
