"""Ingest: store one agent batch, keep run and rank state, and queue steps for rollup.

Idempotent: a step replayed after a restart (same run, rank and step) overwrites the
earlier row, and an event whose id was seen before is ignored. A rank that comes
back with a new process session is recorded as a ``restart`` event.
"""

from __future__ import annotations

import functools
import math
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    Float,
    bindparam,
    case,
    func,
    null,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from . import models as m
from .db import is_sqlite
from .schemas import AgentInfo, ColumnarBatch, IngestBatch, IngestResult, StepIn


def _insert(conn: Connection, table: Any) -> Any:
    return (sqlite.insert if is_sqlite(conn) else postgresql.insert)(table)


@functools.lru_cache(maxsize=64)
def _upsert_stmt(dialect: str, table: Any, columns: tuple[str, ...], key: tuple[str, ...]) -> Any:
    stmt = (sqlite.insert if dialect == "sqlite" else postgresql.insert)(table)
    return stmt.on_conflict_do_update(
        index_elements=list(key), set_={c: stmt.excluded[c] for c in columns if c not in key}
    )


def upsert(conn: Connection, table: Any, rows: list[dict[str, Any]], *, key: list[str]) -> None:
    """Insert ``rows``; on a key conflict, overwrite every other column."""
    if not rows:
        return
    conn.execute(_upsert_stmt(conn.dialect.name, table, tuple(rows[0]), tuple(key)), rows)


# Run ids never change once a run exists: remember them per database.
_run_ids: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()


def _run_id(conn: Connection, *, name: str, world_size: int, now: float) -> int:
    """The run's id, creating the run on its first batch (two ranks may race: both fine).

    Only an id found already committed is cached: one this transaction inserts could
    still roll back, and a concurrent request must not use it before it commits.
    """
    known = _run_ids.setdefault(conn.engine, {})
    if name in known:
        return known[name]
    query = select(m.runs.c.id).where(m.runs.c.name == name)
    found = conn.execute(query).scalar_one_or_none()
    if found is not None:
        known[name] = int(found)
        return int(found)
    stmt = _insert(conn, m.runs).on_conflict_do_nothing(index_elements=["name"])
    conn.execute(
        stmt, {"name": name, "created_at": now, "updated_at": now, "world_size": world_size}
    )
    return int(conn.execute(query).scalar_one())


def forget_runs(engine: Engine) -> None:
    """Drop the cached run ids: after a failed transaction one may name a run never stored."""
    _run_ids.pop(engine, None)


def _track_ranks(
    conn: Connection, *, run_id: int, agents: list[tuple[AgentInfo, list[StepIn]]], now: float
) -> None:
    """Heartbeat and progress of the ranks in a request, in three statements whatever
    their number; a rank back with a new process session gets a ``restart`` event."""
    rk = m.ranks.c
    agents = sorted(agents, key=lambda pair: pair[0].rank)  # rank order, as the evaluator locks
    previous = dict(
        conn.execute(
            select(rk.rank, rk.session).where(
                rk.run_id == run_id, rk.rank.in_([a.rank for a, _ in agents])
            )
        ).all()
    )
    restarts = [a for a, _ in agents if a.rank in previous and previous[a.rank] != a.session]
    if restarts:
        conn.execute(
            _insert(conn, m.events).on_conflict_do_nothing(index_elements=["uid"]),
            [
                {
                    # Derived from both sessions so that a replayed batch cannot add it twice.
                    "uid": uuid.uuid5(uuid.NAMESPACE_OID, f"restart:{previous[a.rank]}:{a.session}").hex,
                    "run_id": run_id, "rank": a.rank, "step": None, "ts": a.started_at or now, "recv_ts": now,
                    "kind": "restart", "severity": "warning",
                    "data": {"previous_session": previous[a.rank], "session": a.session, "pid": a.pid},
                }
                for a in restarts
            ],
        )  # fmt: skip
    rows = []
    for agent, steps in agents:
        last_step = max((s.step for s in steps), default=None)
        if agent.last_step is not None:
            last_step = agent.last_step if last_step is None else max(agent.last_step, last_step)
        rows.append({
            "run_id": run_id, "rank": agent.rank, "local_rank": agent.local_rank, "host": agent.host,
            "node": agent.node or agent.host, "pid": agent.pid, "session": agent.session,
            "first_seen": now, "last_seen": now,  # every request is a heartbeat
            "last_step": last_step, "state": "healthy", "state_since": now,
            "heartbeat_s": agent.heartbeat_s,
            "progress_at": agent.last_step_end,  # none before the first step: no hung verdict yet
            "in_step": None if agent.in_step is None else int(agent.in_step), "phase": agent.phase,
            "clock_skew_s": None if agent.sent_at is None else now - agent.sent_at,
        })  # fmt: skip
    new = [row for row in rows if row["rank"] not in previous]
    if new:
        conn.execute(_insert(conn, m.ranks), new)
    known = [{**row, "b_rank": row["rank"]} for row in rows if row["rank"] in previous]
    if not known:
        return
    renewed = rk.session != bindparam(
        "session"
    )  # a new process: healthy until the evaluator says not
    conn.execute(
        update(m.ranks)
        .where(rk.run_id == run_id, rk.rank == bindparam("b_rank"))
        .values(
            local_rank=bindparam("local_rank"), host=bindparam("host"), node=bindparam("node"),
            pid=bindparam("pid"), last_seen=bindparam("last_seen"), heartbeat_s=bindparam("heartbeat_s"),
            in_step=bindparam("in_step"), phase=bindparam("phase"), clock_skew_s=bindparam("clock_skew_s"),
            last_step=func.coalesce(bindparam("last_step", type_=BigInteger), rk.last_step),
            progress_at=func.coalesce(bindparam("progress_at", type_=Float), rk.progress_at),
            state=case((renewed, "healthy"), else_=rk.state),
            state_since=case((renewed, bindparam("state_since", type_=Float)), else_=rk.state_since),
            state_detail=case((renewed, null()), else_=rk.state_detail),
            session=bindparam("session"),
        ),
        known,
    )  # fmt: skip


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


def _step_rows(
    *, run_id: int, pairs: Iterable[tuple[int, StepIn]], now: float
) -> list[dict[str, Any]]:
    rows = []
    for rank, s in pairs:
        row = s.model_dump(include=_STEP_COLUMNS)
        issues = dict(s.issues or {})
        for name in ("loss", "grad_norm"):
            value = row[name]
            if value is not None and not math.isfinite(value):
                # SQLite cannot store NaN: keep the fact in `issues` on every backend.
                issues[name] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
                row[name] = None
        row.update(run_id=run_id, rank=rank, recv_ts=now, issues=issues or None)
        rows.append(row)
    # A batch may carry the same step twice (a replay inside one batch): last one wins.
    return list({(row["rank"], row["step"]): row for row in rows}.values())


def _queue_rollups(conn: Connection, *, run_id: int, steps: set[int], now: float) -> None:
    """Tell the rollup worker about these steps. DO NOTHING when already queued: no row
    lock, so the ranks of one step never queue behind each other here."""
    if not steps:
        return
    stmt = _insert(conn, m.rollup_queue).on_conflict_do_nothing(index_elements=["run_id", "step"])
    conn.execute(
        stmt, [{"run_id": run_id, "step": step, "first_seen": now} for step in sorted(steps)]
    )


# When this process last wrote each run's row: it is shared by every rank, so it is
# touched at most once a second (and always when a rank says goodbye).
_run_touched: weakref.WeakKeyDictionary[Engine, dict[int, float]] = weakref.WeakKeyDictionary()
RUN_TOUCH_S = 1.0


def ingest(conn: Connection, *, batch: IngestBatch, now: float | None = None) -> IngestResult:
    """Store ``batch`` in the caller's transaction."""
    now = time.time() if now is None else now
    run_id = _run_id(conn, name=batch.run, world_size=batch.agent.world_size, now=now)
    _track_ranks(conn, run_id=run_id, agents=[(batch.agent, batch.steps)], now=now)

    rows = _step_rows(run_id=run_id, pairs=((batch.agent.rank, s) for s in batch.steps), now=now)
    upsert(conn, m.rank_steps, rows, key=["run_id", "step", "rank"])
    _queue_rollups(conn, run_id=run_id, steps={row["step"] for row in rows}, now=now)

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
    _update_run(
        conn,
        run_id=run_id,
        world_size=batch.agent.world_size,
        last=max((s.step for s in batch.steps), default=batch.agent.last_step),
        shutdown=any(e.kind == "shutdown" for e in batch.events),
        now=now,
    )
    return IngestResult(accepted_steps=len(rows), accepted_events=accepted_events)


def _update_run(
    conn: Connection, *, run_id: int, world_size: int, last: int | None, shutdown: bool, now: float
) -> None:
    """Last: this row is shared by every rank of the run, so hold its lock briefly."""
    touched = _run_touched.setdefault(conn.engine, {})
    if not shutdown and now - touched.get(run_id, 0.0) < RUN_TOUCH_S:
        return
    touched[run_id] = now
    values: dict[str, Any] = {"updated_at": now, "world_size": world_size}
    if last is not None:
        r = m.runs.c
        values["last_step"] = case(
            (or_(r.last_step.is_(None), r.last_step < last), last), else_=r.last_step
        )
    if not shutdown:
        conn.execute(update(m.runs).where(m.runs.c.id == run_id).values(status="running", **values))
        return
    # A rank said goodbye: count how the ranks ended (rare, so a scan is fine).
    counts = conn.execute(
        select(
            func.count(),
            func.sum(case((m.ranks.c.state.in_(("finished", "failed")), 1), else_=0)),
            func.sum(case((m.ranks.c.state == "failed", 1), else_=0)),
        ).where(m.ranks.c.run_id == run_id)
    ).one()
    seen, ended, failed = counts[0], counts[1] or 0, counts[2] or 0
    status = "running"
    if seen >= world_size and ended == seen:  # every rank said goodbye
        status = "failed" if failed else "finished"
    conn.execute(update(m.runs).where(m.runs.c.id == run_id).values(status=status, **values))


def ingest_columns(
    conn: Connection, *, batch: ColumnarBatch, now: float | None = None
) -> IngestResult:
    """Store several ranks' steps (a node's, say) in the caller's transaction."""
    now = time.time() if now is None else now
    run_id = _run_id(conn, name=batch.run, world_size=batch.world_size, now=now)
    pairs = batch.rows()
    by_rank: dict[int, list[StepIn]] = defaultdict(list)
    for rank, s in pairs:
        by_rank[rank].append(s)
    _track_ranks(
        conn, run_id=run_id, agents=[(a, by_rank.get(a.rank, [])) for a in batch.agents], now=now
    )
    rows = _step_rows(run_id=run_id, pairs=pairs, now=now)
    upsert(conn, m.rank_steps, rows, key=["run_id", "step", "rank"])
    _queue_rollups(conn, run_id=run_id, steps={row["step"] for row in rows}, now=now)
    last = max((s.step for _, s in pairs), default=None)
    _update_run(
        conn, run_id=run_id, world_size=batch.world_size, last=last, shutdown=False, now=now
    )
    return IngestResult(accepted_steps=len(rows), accepted_events=0)
