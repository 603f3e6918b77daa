"""Rollups: per-step aggregates across ranks (``aggregate``: Python and SQL twins of the
metric catalog in ``trainwarden.alerts.metrics``) and the worker that writes them to
``step_stats`` and the time buckets (``worker``).

May import ``collector.store``; a sibling of ``collector.ingest``, which it never imports.
"""
