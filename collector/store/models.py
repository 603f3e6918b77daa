"""Storage schema (SQLAlchemy 2 Core). Alembic migrations in ``migrations/`` create it.

Times are epoch seconds (double precision) everywhere: the agent stamps wall-clock
time, the collector stamps receive time, and the two can be compared for skew.
Per-rank step data is one wide row per (run, step, rank); the key starts with the
step so inserts land at the right edge of the b-tree (see shared/RECIPES.md).

The whole schema in one module (some 500 lines of table definitions): it is read, and
changed with a migration, as one thing.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

USER_METRICS_TYPE = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

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

# Per-rank raw data is partitioned by day on PostgreSQL (migration 0006) so that
# `trainwarden db prune --keep-raw` drops old days whole. ``day`` is the UTC day of
# the record's own timestamp: a replayed record lands on the same key.
PARTITION_BY = "RANGE (day)"

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
    Column("duration_s", Float, nullable=False),
    Column("data_wait_s", Float),
    Column("tokens", BigInteger),
    Column("loss", Float),
    Column("issues", JSON(none_as_null=True)),
    # Step telemetry (migration 0002): phases, communication split, MFU, grad norm, memory.
    Column("fwd_s", Float),
    Column("bwd_s", Float),
    Column("opt_s", Float),
    Column("other_s", Float),
    Column("compute_s", Float),
    Column("exposed_comm_s", Float),
    Column("overlapped_comm_s", Float),
    Column("idle_s", Float),
    Column("comm_source", String(16)),
    Column("grad_norm", Float),
    Column("flops", Float),
    Column("mfu", Float),
    Column("peak_flops", Float),
    Column("flops_source", String(128)),
    Column("peak_source", String(255)),
    Column("mem_allocated_bytes", BigInteger),
    Column("mem_reserved_bytes", BigInteger),
    Column("rss_bytes", BigInteger),
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
    Column("duration_s", Float),
    Column("loss", Float),
    Column("grad_norm", Float),
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


# Replica fingerprints (migration 0025): on a checked step, each rank's fingerprint of its
# parameters after the optimizer step, and the replica group it belongs to; the health
# evaluator compares a step's fingerprints within each group (``replica_results``). A
# step run again (a rollback, a restart) replaces its check: the later execution wins.
replica_checks = Table(
    "replica_checks",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("ts", Float, nullable=False),  # the step's start (which execution)
    Column("recv_ts", Float, nullable=False),
    Column("replica_group", String(1024), nullable=False),
    Column("fingerprint", String(32), nullable=False),
    # A probed step's (migration 0026): the output's fingerprint and sums, the tolerance
    Column("probe", String(32)),
    Column("probe_sums", JSON),
    Column("probe_rtol", Float),
    # The evaluator reads a run's recent checks each second: not the whole run's.
    Index("ix_replica_checks_run_id_recv_ts", "run_id", "recv_ts"),
)

# One comparison of a step's fingerprints within one replica group: agreed, or the
# suspects by majority, and the ranks that sent none (left out of it).
replica_results = Table(
    "replica_results",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("replica_group", String(1024), primary_key=True),
    Column("decided_at", Float, nullable=False),
    Column("agree", Boolean, nullable=False),
    Column("suspects", JSON, nullable=False),  # ranks out of the majority
    Column("missing", JSON, nullable=False),  # members that sent no fingerprint
    Column("fingerprints", Integer, nullable=False),  # how many were compared
    # The determinism probes of that step (migration 0026); NULL: no probe compared
    Column("probe_suspects", JSON),
    Column("probes", Integer),
)


# Sample ids (migration 0027): on a step where the trainer called s.samples(ids), the
# rank's order-sensitive digest of them and their count. A later execution (a replay, a
# restart) replaces digest and count; first_digest keeps the first execution's.
sample_digests = Table(
    "sample_digests",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("ts", Float, nullable=False),  # the step's start (which execution)
    Column("recv_ts", Float, nullable=False),
    Column("digest", String(16), nullable=False),
    Column("count", Integer, nullable=False),
    Column("first_digest", String(16), nullable=False),
    # With a dataset size (migration 0028): the step's epoch, and its ids (all of them, or
    # those of the dataset's fixed sample) as little-endian int64 (agent/samples.py).
    Column("epoch", Integer),
    Column("kept", LargeBinary),
    Index("ix_sample_digests_run_id_recv_ts", "run_id", "recv_ts"),
    Index("ix_sample_digests_run_id_epoch", "run_id", "epoch"),
)


# s.data_source(name, tokens) (migration 0028): the tokens a rank's step drew from each
# source of the run's mixture. A later execution of the step replaces them.
source_tokens = Table(
    "source_tokens",
    metadata,
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True),
    Column("step", BigInteger, primary_key=True),
    Column("rank", Integer, primary_key=True),
    Column("source", String(32), primary_key=True),
    Column("ts", Float, nullable=False),
    Column("tokens", BigInteger, nullable=False),
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

# -- alerts (migration 0007) ---------------------------------------------------------
# One row per episode of an alert: a fingerprint (rule + labels) that goes pending,
# maybe fires, and resolves. A pending episode that clears before it fires is deleted,
# as Prometheus forgets it. The engine (collector/alerting/engine.py) is the only writer
# besides acknowledgements.

alerts = Table(
    "alerts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("fingerprint", String(32), nullable=False),
    Column("rule", String(64), nullable=False),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("rank", Integer),
    Column("node", String(255)),
    Column("gpu", String(64)),
    Column("severity", String(16), nullable=False),
    Column("state", String(16), nullable=False),  # pending | firing | resolved
    Column("labels", JSON, nullable=False),
    Column("annotations", JSON, nullable=False),
    Column("value", Float),
    Column("step", BigInteger),
    Column("action", String(16), nullable=False, server_default="none"),
    Column("active_since", Float, nullable=False),
    Column("active_since_step", BigInteger),
    Column("onset_step", BigInteger),  # where the anomaly began in the data (0023)
    Column("fired_at", Float),
    Column("fired_at_step", BigInteger),  # the step it fired at (0019)
    Column("cleared_at", Float),
    Column("cleared_at_step", BigInteger),
    Column("resolved_at", Float),
    Column("updated_at", Float, nullable=False),
    Column("acked_at", Float),
    Column("acked_by", String(128)),
    Column("ack_comment", String(1000)),
    Column("silenced_by", Integer),
    Column("inhibited_by", Integer),
    Column("notified", String(16)),  # the last status sent to the notifiers
    # The fingerprint it was last notified under: its own, or its storm group's.
    Column("notified_as", String(32)),
    Column("last_sent_at", Float),
    Index("ix_alerts_state", "state"),
    Index("ix_alerts_run_id_active_since", "run_id", "active_since"),
    Index("ix_alerts_fingerprint", "fingerprint"),
)

alert_deliveries = Table(
    "alert_deliveries",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("alert_id", Integer, ForeignKey("alerts.id", ondelete="CASCADE"), nullable=False),
    Column("receiver", String(64), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("status", String(16), nullable=False),  # the notification's: firing | resolved
    Column("attempt", Integer, nullable=False),
    Column("ok", Integer, nullable=False),
    Column("http_status", Integer),
    Column("error", String(1000)),
    Column("at", Float, nullable=False),
    Column("duration_s", Float, nullable=False),
    Column("final", Integer, nullable=False),
    Index("ix_alert_deliveries_alert_id", "alert_id"),
)

silences = Table(
    "silences",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("matchers", JSON, nullable=False),  # [{name, value, regex}]
    Column("starts_at", Float, nullable=False),
    Column("ends_at", Float, nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("comment", String(1000), nullable=False),
    Column("created_at", Float, nullable=False),
)

# -- actions (migration 0008) --------------------------------------------------------
# What trainwarden does about an alert (or an operator asks for): a rollback of the run
# to a good checkpoint, the eviction of a node, a stop. Each is a row with a state
# machine (proposed -> approved -> executing -> done | failed | cancelled) and its
# history; commands to ranks ride back on the agents' own ingest requests.

actions = Table(
    "actions",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("kind", String(16), nullable=False),  # rollback | evict | stop
    Column("state", String(16), nullable=False),
    Column("mode", String(16), nullable=False),  # auto | require-ack | dry-run
    Column("trigger", String(128), nullable=False),  # "rule:LossSpike" | "operator:ana"
    Column("alert_id", Integer),
    Column("fingerprint", String(64)),  # idempotency: one action per alert episode and kind
    Column("rank", Integer),
    Column("node", String(255)),
    Column("approver", String(128)),
    Column("plan", JSON(none_as_null=True)),
    Column("result", JSON(none_as_null=True)),
    Column("reason", String(2000)),  # why it failed or was cancelled
    Column("history", JSON, nullable=False),  # [{at, state, by, detail}]
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float),
    Index("ix_actions_state", "state"),
    Index("ix_actions_run_id_created_at", "run_id", "created_at"),
    Index("ix_actions_fingerprint", "fingerprint"),
)

agent_commands = Table(
    "agent_commands",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    # None: a request of the health evaluator or an operator, not an action's (migration
    # 0024): read the Flight Recorder ({"type": "collectives"}).
    Column("action_id", Integer, ForeignKey("actions.id", ondelete="CASCADE")),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("rank", Integer, nullable=False),
    Column("body", JSON, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("delivered_at", Float),
    Column("done_at", Float),  # acknowledged by the rank, or no longer needed
    Index("ix_agent_commands_run_id_rank", "run_id", "rank"),
)

# -- incidents and the operator logbook (migration 0009) ----------------------------
# An incident groups what happened to a run around one problem: the alerts that fired,
# the actions taken, and (by time) the run's events and notes. The incident engine
# (collector/incidents/store.py) opens one on the first firing alert of a run, gathers what
# follows and closes it once everything resolved and a cool-down passed; operators
# open, close, merge and retitle them through the API.

incidents = Table(
    "incidents",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("title", String(200), nullable=False),
    Column("state", String(16), nullable=False),  # open | closed | merged
    Column("severity", String(16), nullable=False),
    Column("auto", Integer, nullable=False),  # opened by the engine, which also closes it
    Column("opened_at", Float, nullable=False),
    Column("opened_by", String(128), nullable=False),
    Column("closed_at", Float),
    Column("closed_by", String(128)),
    Column("summary", String(2000)),
    Column("merged_into", Integer),
    Column("ranks", JSON, nullable=False),  # the ranks and nodes involved
    Column("nodes", JSON, nullable=False),
    Column("history", JSON, nullable=False),  # [{at, what, by, detail}]
    Column("updated_at", Float, nullable=False),
    Column("posted_at", Float),  # the report posted on close (serve --postmortem-post)
    Column("post_status", String(300)),
    Index("ix_incidents_run_id_opened_at", "run_id", "opened_at"),
    Index("ix_incidents_state", "state"),
)

# Which alerts and actions belong to which incident: each to one at most.
incident_items = Table(
    "incident_items",
    metadata,
    Column("kind", String(16), primary_key=True),  # alert | action
    Column("item_id", Integer, primary_key=True),
    Column("incident_id", Integer, ForeignKey("incidents.id", ondelete="CASCADE"), nullable=False),
    Column("added_at", Float, nullable=False),
    Index("ix_incident_items_incident_id", "incident_id"),
)

notes = Table(
    "notes",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", Integer, ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
    Column("incident_id", Integer, ForeignKey("incidents.id", ondelete="SET NULL")),
    Column("author", String(128), nullable=False),
    Column("text", String(10_000), nullable=False),
    Column("at", Float, nullable=False),  # what the note is about (default: when written)
    Column("step", BigInteger),
    Column("created_at", Float, nullable=False),
    Index("ix_notes_run_id_at", "run_id", "at"),
)

# API tokens (``trainwarden token create``). Only a hash of the secret is stored; the
# token itself is shown once, at creation. ``token_id`` is the public part of the token
# (``tw_<token_id>_<secret>``): the row is found by it, the secret is checked against
# ``secret_hash``.
tokens = Table(
    "tokens",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("token_id", String(16), nullable=False, unique=True),
    Column("name", String(64), nullable=False, unique=True),
    Column("secret_hash", String(64), nullable=False),  # sha256, hex
    Column("scopes", JSON, nullable=False),  # ["ingest"], ["read"], ["admin"], ...
    Column("runs", String(128), nullable=False),  # glob of the runs an ingest token may send
    Column("created_at", Float, nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("revoked_at", Float),
    Column("last_used_at", Float),  # written at most once a minute per token
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
