"""Reads: the queries the API and the UI share (``queries``), the read response models
(``schemas``), goodput and cost (``economics``), user-metric lookups and the runbooks.

May import ``collector.store``, ``collector.ingest`` (its wire models) and
``collector.rollups``; nothing above (health, alerting, actions, incidents, api).
"""
