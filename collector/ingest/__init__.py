"""Ingest: the wire schemas agents send (``schemas``), storing a batch (``batches``), the
writer thread that groups requests into flushes (``writer``), attempts and restarts
(``attempts``), request limits and back-pressure (``limits``) and user-metric checks.

May import ``collector.store`` (and ``alerts``, ``agent``); never the rollups, reads or
anything above.
"""
