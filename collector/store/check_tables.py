"""The checks on steps: replica fingerprints and their comparisons within a replica
group, sample-id digests, and the tokens each step drew from each data source."""

from __future__ import annotations

from sqlalchemy import Column, ForeignKey, Index, Table
from sqlalchemy.types import JSON, BigInteger, Boolean, Float, Integer, LargeBinary, String

from trainwarden.collector.store.table_base import metadata

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
