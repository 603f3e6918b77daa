"""Ingest: store one agent batch, keep run and rank state, and roll steps up.

Idempotent: a step replayed after a restart (same run, rank and step) overwrites the
earlier row, and an event whose id was seen before is ignored. A rank that comes
back with a new process session is recorded as a ``restart`` event.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from sqlalchemy import Connection, case, func, select, update
from sqlalchemy.dialects import postgresql, sqlite

from . import models as m
from .db import is_sqlite
from .rollups import aggregate
from .schemas import IngestBatch, IngestResult


def _insert(conn: Connection, table: Any) -> Any:
    return (sqlite.insert if is_sqlite(conn) else postgresql.insert)(table)


def upsert(conn: Connection, table: Any, rows: list[dict[str, Any]], *, key: list[str]) -> None:
    """Insert ``rows``; on a key conflict, overwrite every other column."""
    if not rows:
        return
    stmt = _insert(conn, table)
    stmt = stmt.on_conflict_do_update(
        index_elements=key,
        set_={c: stmt.excluded[c] for c in rows[0] if c not in key},
    )
    conn.execute(stmt, rows)


def _lock_run(conn: Connection, *, name: str, world_size: int, now: float) -> int:
    """Return the run's id, creating it if needed, and hold its row lock until commit.

    The lock serializes ingest of one run on PostgreSQL so that the rollup of a step
    always sees every rank's committed row (SQLite's BEGIN IMMEDIATE does the same).
    """
    stmt = _insert(conn, m.runs).on_conflict_do_nothing(index_elements=["name"])
    conn.execute(
        stmt, {"name": name, "created_at": now, "updated_at": now, "world_size": world_size}
    )
    query = select(m.runs.c.id).where(m.runs.c.name == name)
    if not is_sqlite(conn):
        query = query.with_for_update()
    return int(conn.execute(query).scalar_one())


def _track_rank(conn: Connection, *, run_id: int, batch: IngestBatch, now: float) -> None:
    agent = batch.agent
    previous = conn.execute(
        select(m.ranks.c.session).where(m.ranks.c.run_id == run_id, m.ranks.c.rank == agent.rank)
    ).scalar_one_or_none()
    if previous is not None and previous != agent.session:
        conn.execute(
            _insert(conn, m.events).on_conflict_do_nothing(index_elements=["uid"]),
            {
                # Derived from both sessions so that a replayed batch cannot add it twice.
                "uid": uuid.uuid5(uuid.NAMESPACE_OID, f"restart:{previous}:{agent.session}").hex,
                "run_id": run_id,
                "rank": agent.rank,
                "step": None,
                "ts": agent.started_at or now,
                "recv_ts": now,
                "kind": "restart",
                "severity": "warning",
                "data": {"previous_session": previous, "session": agent.session, "pid": agent.pid},
            },
        )
    last_step = max((s.step for s in batch.steps), default=None)
    if agent.last_step is not None:
        last_step = max(agent.last_step, last_step) if last_step is not None else agent.last_step
    row = {
        "run_id": run_id,
        "rank": agent.rank,
        "local_rank": agent.local_rank,
        "host": agent.host,
        "node": agent.node or agent.host,
        "pid": agent.pid,
        "session": agent.session,
        "first_seen": now,
        "last_seen": now,  # every batch is a heartbeat
        "last_step": last_step,
        "state": "healthy",
        "state_since": now,
        "heartbeat_s": agent.heartbeat_s,
        "progress_at": agent.last_step_end,  # none before the first step: no hung verdict yet
        "in_step": None if agent.in_step is None else int(agent.in_step),
        "phase": agent.phase,
        "clock_skew_s": None if agent.sent_at is None else now - agent.sent_at,
    }
    if previous is None:
        conn.execute(_insert(conn, m.ranks), row)
        return
    keep = ("local_rank", "host", "node", "pid", "session", "last_seen", "heartbeat_s", "in_step", "phase",
            "clock_skew_s")  # fmt: skip
    changes: dict[str, Any] = {k: row[k] for k in keep}
    if previous != agent.session:  # a new process: healthy until the evaluator says otherwise
        changes.update(state="healthy", state_since=now, state_detail=None)
    if last_step is not None:
        changes["last_step"] = last_step
    if row["progress_at"] is not None:
        changes["progress_at"] = row["progress_at"]
    conn.execute(
        update(m.ranks)
        .where(m.ranks.c.run_id == run_id, m.ranks.c.rank == agent.rank)
        .values(changes)
    )


def _store_gpu(conn: Connection, *, run_id: int, batch: IngestBatch, now: float) -> None:
    if not batch.gpu:
        return
    rows = [
        {**g.model_dump(), "run_id": run_id, "rank": batch.agent.rank, "recv_ts": now,
         "remap_pending": None if g.remap_pending is None else int(g.remap_pending),
         "simulated": int(g.simulated)}
        for g in batch.gpu
    ]  # fmt: skip
    conn.execute(_insert(conn, m.gpu_samples).on_conflict_do_nothing(), rows)
    latest = max(batch.gpu, key=lambda g: g.ts)
    conn.execute(
        update(m.ranks)
        .where(m.ranks.c.run_id == run_id, m.ranks.c.rank == batch.agent.rank)
        .values(
            gpu={"uuid": latest.gpu_uuid, "name": latest.gpu_name, "simulated": latest.simulated}
        )
    )


# Every wire field of a step that is a rank_steps column of the same name.
_STEP_COLUMNS = {c.name for c in m.rank_steps.columns} - {"run_id", "rank", "recv_ts", "issues"}


def _step_rows(*, run_id: int, batch: IngestBatch, now: float) -> list[dict[str, Any]]:
    rows = []
    for s in batch.steps:
        row = s.model_dump(include=_STEP_COLUMNS)
        issues = dict(s.issues or {})
        for name in ("loss", "grad_norm"):
            value = row[name]
            if value is not None and not math.isfinite(value):
                # SQLite cannot store NaN: keep the fact in `issues` on every backend.
                issues[name] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
                row[name] = None
        row.update(run_id=run_id, rank=batch.agent.rank, recv_ts=now, issues=issues or None)
        rows.append(row)
    # A batch may carry the same step twice (a replay inside one batch): last one wins.
    return list({row["step"]: row for row in rows}.values())


def _roll_up(conn: Connection, *, run_id: int, steps: set[int]) -> None:
    if not steps:
        return
    rows = (
        conn.execute(
            select(m.rank_steps).where(
                m.rank_steps.c.run_id == run_id, m.rank_steps.c.step.in_(steps)
            )
        )
        .mappings()
        .all()
    )
    by_step: dict[int, list[Any]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    stats = [stat for step, group in by_step.items() for stat in aggregate(run_id, step, group)]
    upsert(conn, m.step_stats, stats, key=["run_id", "metric", "step"])


def ingest(conn: Connection, *, batch: IngestBatch, now: float | None = None) -> IngestResult:
    """Store ``batch`` in the caller's transaction."""
    now = time.time() if now is None else now
    run_id = _lock_run(conn, name=batch.run, world_size=batch.agent.world_size, now=now)
    _track_rank(conn, run_id=run_id, batch=batch, now=now)

    rows = _step_rows(run_id=run_id, batch=batch, now=now)
    upsert(conn, m.rank_steps, rows, key=["run_id", "step", "rank"])
    _roll_up(conn, run_id=run_id, steps={row["step"] for row in rows})

    accepted_events = 0
    if batch.events:
        inserted = conn.execute(
            _insert(conn, m.events)
            .on_conflict_do_nothing(index_elements=["uid"])
            .returning(m.events.c.id),
            [
                {
                    "uid": e.id,
                    "run_id": run_id,
                    "rank": batch.agent.rank,
                    "step": e.step,
                    "ts": e.ts,
                    "recv_ts": now,
                    "kind": e.kind,
                    "severity": e.severity,
                    "data": e.data,
                }
                for e in batch.events
            ],
        )
        accepted_events = len(inserted.all())  # events seen before are not counted again
        for e in batch.events:
            if e.kind == "gpu_telemetry":  # "ok" with the device, or "unavailable" and why
                conn.execute(
                    update(m.ranks)
                    .where(m.ranks.c.run_id == run_id, m.ranks.c.rank == batch.agent.rank)
                    .values(gpu=e.data)
                )
        for e in batch.events:
            if e.kind == "shutdown":  # failed: the process ended on an exception in a step
                failed = bool(e.data.get("error"))
                conn.execute(
                    update(m.ranks)
                    .where(m.ranks.c.run_id == run_id, m.ranks.c.rank == batch.agent.rank)
                    .values(
                        state="failed" if failed else "finished",
                        state_since=now,
                        state_detail={"reason": e.data["error"]} if failed else None,
                    )
                )

    _store_gpu(conn, run_id=run_id, batch=batch, now=now)
    _update_run(conn, run_id=run_id, batch=batch, now=now)
    return IngestResult(accepted_steps=len(rows), accepted_events=accepted_events)


def _update_run(conn: Connection, *, run_id: int, batch: IngestBatch, now: float) -> None:
    counts = conn.execute(
        select(
            func.count(),
            func.sum(case((m.ranks.c.state.in_(("finished", "failed")), 1), else_=0)),
            func.sum(case((m.ranks.c.state == "failed", 1), else_=0)),
            func.max(m.ranks.c.last_step),
        ).where(m.ranks.c.run_id == run_id)
    ).one()
    seen, ended, failed, last_step = counts[0], counts[1] or 0, counts[2] or 0, counts[3]
    world = batch.agent.world_size
    status = "running"
    if seen >= world and ended == seen:  # every rank said goodbye
        status = "failed" if failed else "finished"
    conn.execute(
        update(m.runs)
        .where(m.runs.c.id == run_id)
        .values(updated_at=now, world_size=world, last_step=last_step, status=status)
    )
