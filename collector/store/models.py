"""Storage schema (SQLAlchemy 2 Core): every table, and the ``metadata`` they are declared
on. Alembic migrations in ``migrations/`` create it.

Times are epoch seconds (double precision) everywhere: the agent stamps wall-clock
time, the collector stamps receive time, and the two can be compared for skew.
Per-rank step data is one wide row per (run, step, rank); the key starts with the
step so inserts land at the right edge of the b-tree (see shared/RECIPES.md).

Each table is declared once, in the module of its concern: runs, ranks, attempts and
the collectors' pressure (``run_tables``), steps and their rollups (``step_tables``),
events and GPU samples (``telemetry_tables``), replica, sample and data-source checks
(``check_tables``), alerts, actions, incidents and notes (``alert_tables``), API tokens
(``token_tables``); the ``MetaData`` they share is ``table_base``'s. This module imports
them all, so ``models.metadata`` is the whole schema, and ``models.<table>`` any table.
"""

from __future__ import annotations

from trainwarden.collector.store.alert_tables import (
    actions,
    agent_commands,
    alert_deliveries,
    alerts,
    incident_items,
    incidents,
    notes,
    silences,
)
from trainwarden.collector.store.check_tables import (
    replica_checks,
    replica_results,
    sample_digests,
    source_tokens,
)
from trainwarden.collector.store.run_tables import (
    attempt_sessions,
    attempts,
    collector_pressure,
    node_clearances,
    ranks,
    runs,
)
from trainwarden.collector.store.step_tables import (
    bucket_maxima,
    rank_steps,
    replaced_steps,
    rollup_queue,
    step_stats,
)
from trainwarden.collector.store.table_base import metadata
from trainwarden.collector.store.telemetry_tables import events, gpu_samples
from trainwarden.collector.store.token_tables import tokens

__all__ = [
    "actions",
    "agent_commands",
    "alert_deliveries",
    "alerts",
    "attempt_sessions",
    "attempts",
    "bucket_maxima",
    "collector_pressure",
    "node_clearances",
    "events",
    "gpu_samples",
    "incident_items",
    "incidents",
    "metadata",
    "notes",
    "rank_steps",
    "ranks",
    "replaced_steps",
    "replica_checks",
    "replica_results",
    "rollup_queue",
    "runs",
    "sample_digests",
    "silences",
    "source_tokens",
    "step_stats",
    "tokens",
]
