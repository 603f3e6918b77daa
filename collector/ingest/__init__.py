"""Ingest: the wire schemas agents send (``schemas`` and the ``schema_*`` modules), storing
a flush's batches (``batches``, as column-wise requests from ``batch_columns``), the
writer thread that groups requests into flushes (``writer``), attempts and restarts
(``attempts``), request limits and back-pressure (``limits``) and user-metric checks.

May import ``collector.store`` (and ``alerts``, ``agent``); never the rollups, reads or
anything above.
"""
