"""The runs, their ranks and attempts (one row per process of an attempt), the ingest
pressure each collector shares with the others on the database, and the nodes marked
repaired."""

from __future__ import annotations

from sqlalchemy import Column, ForeignKey, Index, Table, UniqueConstraint
from sqlalchemy.types import JSON, BigInteger, Float, Integer, String

from trainwarden.collector.store.table_base import metadata

runs = Table(
    "runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(128), nullable=False, unique=True),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("world_size", Integer, nullable=False),
    Column("last_step", BigInteger),
    Column("status", String(16), nullable=False, server_default="running"),
)

# Every ingest flush updates each of its ranks' rows: on PostgreSQL half of each page is
# left free (fillfactor 50, migration 0031) so that the new version of a row fits beside
# the old one (a HOT update: no index entry, no growth of the table between vacuums).
ranks = Table(
    "ranks",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("local_rank", Integer),
    Column("host", String(255)),
    Column("node", String(255)),
    Column("pid", Integer),
    Column("session", String(64), nullable=False),
    Column("first_seen", Float, nullable=False),
    Column("last_seen", Float, nullable=False),
    Column("last_step", BigInteger),
    # The highest step ever stored for the rank (last_step goes back with a rollback or
    # a restart): steps up to it may be stored already, under another day's partition too.
    Column("high_step", BigInteger),
    Column("state", String(16), nullable=False, server_default="running"),
    # Health (migration 0003): heartbeats, progress and the state the evaluator derives.
    Column("heartbeat_s", Float),
    Column("progress_at", Float),
    Column("in_step", Integer),
    Column("phase", String(32)),
    Column("state_since", Float),
    Column("state_detail", JSON(none_as_null=True)),
    Column("clock_skew_s", Float),
    Column("gpu", JSON(none_as_null=True)),
    # Seconds between the rank's last two requests as they arrived (migration 0017): how
    # far apart the collector really hears from live ranks, which the evaluator allows for.
    Column("arrival_gap_s", Float),
)

# -- run identity and attempts (migration 0011) -------------------------------------
# Every process lifetime of a run is an attempt: a restart after a failure, a rollback
# that restarted the job or an eviction opens the next one. Each rank's agent sends an
# ``attempt_start`` event (config, tags, data snapshot, code version, environment) when
# it starts and an ``attempt_end`` (why it ended) when it ends cleanly; a process that
# dies without a goodbye is noticed when its rank comes back with a new session.

attempts = Table(
    "attempts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("number", Integer, nullable=False),  # 1, 2, ... in the order they started
    Column("key", String(255)),  # the launcher's id (torchelastic / Slurm restart), if any
    Column("started_at", Float, nullable=False),
    Column("world_size", Integer),
    Column("nodes", JSON, nullable=False),  # node (else host) names, as ranks reported
    Column("config", JSON(none_as_null=True)),
    Column("tags", JSON(none_as_null=True)),
    Column("data_snapshot", String(1000)),
    Column("code", JSON(none_as_null=True)),  # {commit, dirty, branch, root}
    Column("env", JSON(none_as_null=True)),  # rank 0's: python, torch, cuda, nccl, gpu ...
    Column("packages_hash", String(64)),
    Column("packages", JSON(none_as_null=True)),  # ["name==version", ...], stored once
    UniqueConstraint("run_id", "number"),
    Index("ix_attempts_run_id_key", "run_id", "key"),
)

# One row per process (agent session) of an attempt: how and when it ended.
attempt_sessions = Table(
    "attempt_sessions",
    metadata,
    Column("session", String(64), primary_key=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("attempt", Integer, nullable=False),  # attempts.number
    Column("rank", Integer, nullable=False),
    Column("host", String(255)),  # its node (the scheduler's name), else its host name
    Column("started_at", Float, nullable=False),
    Column("first_step", BigInteger),
    Column("first_step_at", Float),  # when the process's first step started
    # Filled when the process says goodbye (attempt_end) or, for one that died without
    # one, when its rank comes back with a new session: its last heartbeat and step.
    Column("ended_at", Float),
    Column("last_seen", Float),
    Column("last_step", BigInteger),
    Column("last_step_end", Float),
    Column("end_reason", String(32)),  # completed | exception | sigterm | stopped | lost
    Column("end_detail", String(1000)),
    Column("exit_code", Integer),
    Index("ix_attempt_sessions_run_id_attempt", "run_id", "attempt"),
)

# What each collector process on the database last said of its ingest pressure: when it
# fell behind and whose requests it refused (``ingest.pressure_board``). The leader of a
# health or alert pass reads every collector's, so that a rank whose requests another
# collector refused is not called dead. A row is replaced twice a second while its
# collector is pressed and deleted when it stops; a crashed collector's row goes stale.
collector_pressure = Table(
    "collector_pressure",
    metadata,
    Column("collector", String(128), primary_key=True),  # host:pid:nonce of one process
    Column("behind_at", Float),  # when it last fell behind (epoch seconds); None: not lately
    Column("lag_s", Float, nullable=False),  # its delay then
    Column("heard", JSON, nullable=False),  # {run: [[first rank, last rank, refused at], ...]}
    Column("updated_at", Float, nullable=False),
)

# A node marked repaired (``trainwarden nodes clear``): the findings that implicated it
# before ``cleared_at`` no longer count against it (its record keeps them, marked).
node_clearances = Table(
    "node_clearances",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("node", String(255), nullable=False),
    Column("cleared_at", Float, nullable=False),
    Column("by", String(128), nullable=False),
    Column("note", String(2000), nullable=False),
    Index("ix_node_clearances_node", "node", "cleared_at"),
)
