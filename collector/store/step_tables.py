"""Steps: each rank's record of each step (``rank_steps``, partitioned by day), the
executions a later one replaced, and the rollups across ranks (``step_stats``, the
queue of steps to roll up, the per-rank maxima of heatmap buckets)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, ForeignKey, Index, Table, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.types import JSON, BigInteger, Float, Integer, String

from trainwarden.agent.metric_catalog import FIELDS
from trainwarden.collector.store.table_base import PARTITION_BY, metadata

USER_METRICS_TYPE = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def _catalog_columns(*, replaced: bool = False) -> list[Column[Any]]:
    """A column for each number of the metric catalog (``replaced``: those a replaced
    execution keeps), named as its wire field."""
    return [
        Column(f.name, BigInteger if f.integer else Float, nullable=replaced or not f.required)
        for f in FIELDS
        if f.replaced or not replaced
    ]


# No foreign key to runs on the raw per-rank tables (migration 0015): PostgreSQL checked it
# row by row, half of each insert's cost; ingest writes the run row first, nothing deletes
# runs, and `db prune` drops their days whole.
rank_steps = Table(
    "rank_steps",
    metadata,
    Column("run_id", Integer, primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("day", Integer, primary_key=True),  # floor(ts / 86400)
    Column("ts", Float, nullable=False),
    Column("recv_ts", Float, nullable=False),
    # The step's numbers (the metric catalog: duration, loss, phases, comm split, MFU, ...).
    *_catalog_columns(),
    Column("issues", JSON(none_as_null=True)),
    Column("comm_source", String(16)),
    Column("flops_source", String(128)),
    Column("peak_source", String(255)),
    Column("flags", JSON(none_as_null=True)),
    # User metrics (migration 0012): {name: value} from s.metric(); JSONB on PostgreSQL,
    # so that the rollup can take each value out (metrics->>name) next to the data.
    Column("metrics", USER_METRICS_TYPE),
    # Spike flags and issues (a non-finite value) are rare: a partial index finds a run's
    # notable rows without a scan (the alert engine asks for either, every pass; the
    # timeline and the flagged-steps query for flags: implied, so the index serves too).
    Index(
        "ix_rank_steps_notable",
        "run_id",
        "step",
        postgresql_where=text("flags IS NOT NULL OR issues IS NOT NULL"),
        sqlite_where=text("flags IS NOT NULL OR issues IS NOT NULL"),
    ),
    postgresql_partition_by=PARTITION_BY,
)

# An execution of a step that a later one replaced (a rollback or a restart ran the step
# again; rank_steps keeps the latest): the figures a post-mortem wants to see, since the
# replaced executions are where a spike was. Rare, so not partitioned; pruned with the raw
# data by ``day`` (migration 0020).
replaced_steps = Table(
    "replaced_steps",
    metadata,
    Column("run_id", Integer, nullable=False),
    Column("rank", Integer, nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("day", Integer, nullable=False),
    Column("ts", Float, nullable=False),
    Column("replaced_at", Float, nullable=False),
    *_catalog_columns(replaced=True),
    Column("flags", JSON(none_as_null=True)),
    Column("issues", JSON(none_as_null=True)),
    Index("ix_replaced_steps_run_step", "run_id", "step"),
    # An execution is kept once: two collectors may replace it at the same moment.
    Index("ux_replaced_steps_execution", "run_id", "rank", "step", "ts", unique=True),
)

step_stats = Table(
    "step_stats",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("metric", String(48), primary_key=True),  # a built-in name, or "user." + a user's
    Column("step", BigInteger, primary_key=True),
    Column("ts", Float, nullable=False),
    Column("n", Integer, nullable=False),
    Column("nonfinite", Integer, nullable=False, server_default="0"),
    Column("min", Float),
    Column("median", Float),
    Column("max", Float),
    Column("p99", Float),  # 99th percentile across ranks, interpolated (migration 0014)
    Column("mean", Float),
    Column("total", Float),
    Column("argmax_rank", Integer),
)

# Steps waiting to be rolled up across ranks (see rollup_worker).
rollup_queue = Table(
    "rollup_queue",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("first_seen", Float, nullable=False),
    # Rows ingest has written for the step (a replay counts again) and when it last did:
    # the worker's frequent pass finds complete steps from these, not by counting rows.
    Column("seen_n", Integer, nullable=False, server_default="0"),
    Column("newest", Float),
    Column("rolled_n", Integer),  # rows the last rollup saw
    Column("rolled_at", Float),  # newest receive time the last rollup saw
)

# Per-rank maxima over buckets of 16, 64 and 256 steps, for rank x step heatmaps of long
# runs; written by the rollup worker. One row a bucket with every rank's maximum, ranks[i]'s
# in maxima[i], in rank order (migration 0029; migration 0005 kept a row a rank and bucket:
# a heatmap of 1,024 ranks x 156 cells read 159,744 rows, now 156). Arrays on PostgreSQL,
# JSON lists on SQLite.
RANKS_TYPE = JSON().with_variant(ARRAY(Integer), "postgresql")
MAXIMA_TYPE = JSON().with_variant(ARRAY(Float), "postgresql")
bucket_maxima = Table(
    "bucket_maxima",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("metric", String(32), primary_key=True),
    Column("level", Integer, primary_key=True),
    Column("bucket", BigInteger, primary_key=True),
    Column("ranks", RANKS_TYPE, nullable=False),
    Column("maxima", MAXIMA_TYPE, nullable=False),
)
