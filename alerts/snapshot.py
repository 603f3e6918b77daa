"""What one alert pass knows of one run (:class:`Snapshot`, its ranks and rolled-up
steps) and what a rule says of it (:class:`Verdict`). The engine
(``collector/alerting/snapshot.py``) fills a snapshot from the database; tests build
them by hand; ``evaluate.evaluate`` turns one into verdicts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainwarden.alerts.metrics import METRICS

LIVE_STATES = ("healthy", "slow", "hung", "dead", "running")
"""Rank states that still belong to the job (``finished`` and ``failed`` ranks said goodbye)."""
Row = Mapping[str, Any]

# The rank_steps columns each per-rank metric is computed from (rollups.METRICS).
_DERIVED = {
    "tokens_per_s": ("tokens", "duration_s"),
    "exposed_comm_frac": ("exposed_comm_s", "duration_s"),
}


def metric_columns(metric: str) -> tuple[str, ...]:
    """The ``rank_steps`` columns needed to compute ``metric`` per rank."""
    source = METRICS[metric].source
    return (source, "duration_s") if source else _DERIVED[metric]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: str | None = None
    gpu: str | None = None
    state: str = "healthy"
    role: str | None = None  # culprit | victim, for hung ranks
    collective: str | None = None  # the hung-collective verdict (Flight Recorder), if any
    last_seen: float | None = None
    heartbeat_s: float | None = None
    progress_at: float | None = None
    last_step: int | None = None
    state_since: float | None = None
    hung_since: float | None = None  # when the hang the verdict names began
    ended: str | None = None  # how a rank in a verdict ended: its attempt_end reason


@dataclass(frozen=True)
class StatRow:
    """One run step's rollup of a metric (``step_stats``): stat name -> value."""

    step: int
    ts: float
    values: Mapping[str, float | None]


@dataclass
class Snapshot:
    """What one pass knows of one run. Lists are in time (or step) order."""

    run: str
    now: float
    last_step: int | None = None
    first_step: int | None = None  # the run's first rolled-up step (for warm-up)
    started_at: float | None = None
    attempt_started_at: float | None = None  # the current attempt's (a restart's) start
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    stats: dict[str, list[StatRow]] = field(default_factory=dict)
    steps: list[Row] = field(default_factory=list)  # recent rank_steps rows
    marked: list[Row] = field(default_factory=list)  # rank_steps rows with flags or issues
    gpu: list[Row] = field(default_factory=list)  # recent gpu_samples rows
    events: list[Row] = field(
        default_factory=list
    )  # recent events (kind, rank, step, ts, recv_ts, data)
    last_event: dict[str, float] = field(default_factory=dict)  # kind -> newest ts ever
    median_step_s: float | None = None
    cadence: Mapping[str, Any] | None = None  # the cadence advisor's, when a rule asks
    lag_s: float = 0.0  # the collector's own ingest lag, allowed for by absence rules
    hold_s: float = 10.0

    def live(self) -> list[RankInfo]:
        return [r for r in self.ranks.values() if r.state in LIVE_STATES]

    def by_step(self) -> dict[int, dict[int, Row]]:
        """``steps`` grouped as {step: {rank: row}}, built once a snapshot (peer rules
        each look for the newest complete step among every rank's recent rows)."""
        key = (id(self.steps), len(self.steps))
        if self._by_step is None or self._by_step[0] != key:
            grouped: dict[int, dict[int, Row]] = defaultdict(dict)
            for row in self.steps:
                grouped[row["step"]][row["rank"]] = row
            self._by_step = (key, grouped)
        return self._by_step[1]

    _by_step: tuple[tuple[int, int], dict[int, dict[int, Row]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )


@dataclass(frozen=True)
class Verdict:
    """The condition holds: for the whole run (``rank`` None) or for one rank."""

    rank: int | None
    value: float | None
    detail: str
    step: int | None = None
    onset_step: int | None = None
    """The first step of the streak in which the condition holds, from the data (a
    baseline or threshold rule), or the earliest matching record's own step (an event
    rule): where the anomaly began, not when a pass noticed it. ``None``: not known."""
    annotations: dict[str, str] | None = None
    """Annotations of this verdict's own, beside summary / description / runbook_url
    (``RankHung``, and ``RankDead`` for a dead culprit: ``collective``, the verdict on the
    ranks' Flight Recorder rings; an event rule whose events say ``clean_through``
    (``replica_divergence``): the newest step whose checkpoint is known clean, which a
    rollback restores exactly)."""


def rank_detail(snap: Snapshot, rank: int) -> str:
    """How a verdict names a rank: ``rank 3 (node gpu-07)``."""
    info = snap.ranks.get(rank)
    return f"rank {rank}" + (f" (node {info.node})" if info and info.node else "")
