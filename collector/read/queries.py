"""Read side: the queries the API and the web UI share (the UI never writes its own SQL)."""

from __future__ import annotations

import math
import time
from typing import Any

from sqlalchemy import Connection, func, select

from trainwarden.alerts.metrics import METRICS
from trainwarden.alerts.snapshot import LIVE_STATES
from trainwarden.collector.read import user_metrics as user_metric_reads
from trainwarden.collector.read.schemas import (
    EventOut,
    FlaggedStep,
    GpuSample,
    RankInfo,
    RunDetail,
    RunSummary,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.errors import Invalid, NotFound


class UnknownMetric(Invalid):
    def __init__(
        self, metric: str, user: list[str] | None = None, *, known: list[str] | None = None
    ) -> None:
        # user: the run's user.<name> metrics; known: the only metrics this query has
        names = ", ".join(known if known is not None else [*METRICS, *(user or ())])
        super().__init__(
            f"unknown metric {metric!r}; known metrics: {names}", loc=("query", "metric")
        )


def _from_ranks(fn, label: str):  # type: ignore[no-untyped-def]
    return (
        select(fn)
        .where(m.ranks.c.run_id == m.runs.c.id)
        .correlate(m.runs)
        .scalar_subquery()
        .label(label)
    )


def _run_columns() -> list:  # type: ignore[type-arg]
    """A run's row, with its last step and last update read from its ranks (the run row
    itself is written at most once a second)."""
    r = m.runs.c
    return [
        r.id,
        r.name,
        r.status,
        r.world_size,
        r.created_at,
        _from_ranks(func.count(), "ranks_seen"),
        func.coalesce(_from_ranks(func.max(m.ranks.c.last_step), "x"), r.last_step).label(
            "last_step"
        ),
        func.coalesce(_from_ranks(func.max(m.ranks.c.last_seen), "y"), r.updated_at).label(
            "updated_at"
        ),
    ]


# A run that is running by its ranks' word (none said goodbye) but from which no rank
# has been heard for this long is shown as "lost": every process gone at once (a crash,
# a node or the network down). It is running again as soon as any rank is heard from.
LOST_AFTER_S = 300.0


RUN_STATUS_HELP = {
    "running": "ranks are reporting",
    "finished": "every rank said goodbye, and every process completed",
    "stopped": "ended by SIGTERM or a stop while it trained: no hang, no error (a preemption)",
    "failed": "a process failed, a rank crashed, or the job ended hung in a collective "
    "(torn down or killed with a verdict standing)",
    "lost": "no rank heard from for 5 minutes and none said goodbye: the job died or its "
    "network is down (running again when a rank reports)",
}


def run_status(status: str, updated_at: float | None, now: float) -> str:
    """A run's status as shown: the stored one, or ``lost`` (see :data:`LOST_AFTER_S`)."""
    if status == "running" and updated_at is not None and now - updated_at > LOST_AFTER_S:
        return "lost"
    return status


def _shown(row: Any, now: float) -> dict[str, Any]:
    return {**row, "status": run_status(row["status"], row["updated_at"], now)}


def list_runs(conn: Connection, *, limit: int = 200) -> list[RunSummary]:
    """Runs, most recently updated first."""
    rows = conn.execute(
        select(*_run_columns()).order_by(m.runs.c.updated_at.desc()).limit(limit)
    ).mappings()
    now = time.time()
    return [RunSummary.model_validate(_shown(row, now)) for row in rows]


def _run_row(conn: Connection, name: str) -> Any:
    row = conn.execute(select(*_run_columns()).where(m.runs.c.name == name)).mappings().first()
    if row is None:
        raise NotFound(f"run {name!r} not found")
    return row


def run_id_of(conn: Connection, name: str) -> int:
    """The named run's id, and nothing read from its ranks (a series or heatmap the UI
    polls needs no more; :func:`_run_row` counts the ranks: 12 ms at 16,384)."""
    found = conn.execute(select(m.runs.c.id).where(m.runs.c.name == name)).scalar()
    if found is None:
        raise NotFound(f"run {name!r} not found")
    return int(found)


def get_run(conn: Connection, *, run: str) -> RunDetail:
    row = _run_row(conn, run)
    return RunDetail(
        **_shown(row, time.time()),
        ranks=list_ranks(conn, run_id=row["id"]),
        metrics=[*METRICS, *user_metric_reads.names(conn, run_id=row["id"])],
    )


def list_ranks(conn: Connection, *, run_id: int) -> list[RankInfo]:
    rows = conn.execute(
        select(m.ranks).where(m.ranks.c.run_id == run_id).order_by(m.ranks.c.rank)
    ).mappings()
    return [RankInfo.model_validate(dict(row)) for row in rows]


def ranks(conn: Connection, *, run: str) -> list[RankInfo]:
    return list_ranks(conn, run_id=run_id_of(conn, run))


def events(
    conn: Connection, *, run: str, kind: str | None = None, limit: int = 1000
) -> list[EventOut]:
    run_id = run_id_of(conn, run)
    query = select(m.events).where(m.events.c.run_id == run_id)
    if kind is not None:
        query = query.where(m.events.c.kind == kind)
    rows = conn.execute(query.order_by(m.events.c.ts, m.events.c.id).limit(limit)).mappings()
    return [EventOut.model_validate(dict(row)) for row in rows]


def flagged_steps(conn: Connection, *, run: str, limit: int = 10_000) -> list[FlaggedStep]:
    """Steps with spike flags, oldest first (the partial index keeps this cheap)."""
    run_id = run_id_of(conn, run)
    r = m.rank_steps.c
    rows = conn.execute(
        select(r.step, r.rank, r.flags, r.loss, r.grad_norm)
        .where(r.run_id == run_id, r.flags.is_not(None))
        .order_by(r.step, r.rank)
        .limit(limit)
    ).mappings()
    return [FlaggedStep.model_validate(dict(row)) for row in rows]


def gpu_samples(
    conn: Connection,
    *,
    run: str,
    rank: int | None = None,
    since: float | None = None,
    limit: int = 10_000,
) -> list[GpuSample]:
    """GPU readings of a run (or of one rank), oldest first."""
    run_id = run_id_of(conn, run)
    g = m.gpu_samples.c
    query = select(m.gpu_samples).where(g.run_id == run_id)
    if rank is not None:
        query = query.where(g.rank == rank)
    if since is not None:
        query = query.where(g.ts >= since)
    rows = conn.execute(query.order_by(g.ts.desc()).limit(limit)).mappings().all()
    return [GpuSample.model_validate(dict(row)) for row in reversed(rows)]


def run_metrics(conn: Connection, *, run: str, builtin: list[str]) -> dict[str, Any]:
    """``GET /api/v1/runs/{run}/metrics``: the built-in series names and the run's own."""
    run_id = run_id_of(conn, run)
    return {"run": run, "builtin": builtin, "user": user_metric_reads.names(conn, run_id=run_id)}


def arrival_lateness(conn: Connection, run_id: int) -> float:
    """How much later than its heartbeat interval a live rank of the run last arrived,
    at most (0 when on time): what the collector's own backlog or refusals cost them."""
    k = m.ranks.c
    late = conn.execute(
        select(func.max(k.arrival_gap_s - func.coalesce(k.heartbeat_s, 2.0))).where(
            k.run_id == run_id, k.state.in_(LIVE_STATES)
        )
    ).scalar()
    return max(0.0, late or 0.0)


def median_step_time(conn: Connection, run_id: int) -> float | None:
    s = m.step_stats.c
    values = (
        conn.execute(
            select(s.median)
            .where(s.run_id == run_id, s.metric == "step_time")
            .order_by(s.step.desc())
            .limit(20)
        )
        .scalars()
        .all()
    )
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    return finite[len(finite) // 2] if finite else None
