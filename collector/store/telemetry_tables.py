"""What ranks report besides steps: their events, and their GPU samples (partitioned
by day, as ``rank_steps``)."""

from __future__ import annotations

from sqlalchemy import Column, ForeignKey, Index, Table
from sqlalchemy.types import JSON, BigInteger, Float, Integer, String

from trainwarden.collector.store.table_base import PARTITION_BY, metadata

events = Table(
    "events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("uid", String(64), nullable=False, unique=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("rank", Integer),
    Column("step", BigInteger),
    Column("ts", Float, nullable=False),
    Column("recv_ts", Float, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("severity", String(16), nullable=False),
    Column("data", JSON),
    Index("ix_events_run_id_ts", "run_id", "ts"),
    # The evaluators read a run's events of one kind every pass (migration 0030).
    Index("ix_events_run_id_kind_ts", "run_id", "kind", "ts"),
)

gpu_samples = Table(
    "gpu_samples",
    metadata,
    Column("run_id", Integer, primary_key=True),  # no foreign key: see rank_steps
    Column("rank", Integer, primary_key=True),
    Column("ts", Float, primary_key=True),
    Column("day", Integer, primary_key=True),  # floor(ts / 86400), as for rank_steps
    Column("recv_ts", Float, nullable=False),
    Column("gpu_uuid", String(64)),
    Column("gpu_name", String(128)),
    Column("temp_c", Float),
    Column("mem_temp_c", Float),
    Column("power_w", Float),
    Column("power_limit_w", Float),
    Column("sm_clock_mhz", Float),
    Column("sm_clock_max_mhz", Float),
    Column("throttle", JSON(none_as_null=True)),
    Column("util_gpu", Float),
    Column("util_mem", Float),
    Column("mem_used_bytes", BigInteger),
    Column("mem_total_bytes", BigInteger),
    Column("ecc_corrected", BigInteger),
    Column("ecc_uncorrected", BigInteger),
    Column("retired_pages", BigInteger),
    Column("remapped_rows_correctable", BigInteger),
    Column("remapped_rows_uncorrectable", BigInteger),
    Column("remap_pending", Integer),
    Column("pcie_replay", BigInteger),
    Column("recovery_action", String(32)),
    Column("simulated", Integer, nullable=False, server_default="0"),
    postgresql_partition_by=PARTITION_BY,
)
