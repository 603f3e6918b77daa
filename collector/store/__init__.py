"""Storage: the schema (``models``: every table, declared by concern in the ``*_tables``
modules on ``table_base``'s metadata), engines and transactions (``db``), day partitions,
bulk writes (``bulk``: upserts, binary COPY on PostgreSQL) and API tokens.

The lowest layer of the collector: it imports nothing of the collector above it (only
``trainwarden.agent``'s constants and ``trainwarden.alerts``' pure definitions may be
used here).
"""
