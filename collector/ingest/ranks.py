"""Runs and ranks as ingest keeps them: a run's id (created on its first batch), and each
rank's row (node, session, heartbeat, last and highest step) updated from the newest
header of a flush, a new process session recorded as a ``restart`` event."""

from __future__ import annotations

import uuid
import weakref
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    case,
    func,
    null,
    select,
    text,
)

from trainwarden.collector.ingest import attempts
from trainwarden.collector.ingest.schemas import AGENT_FIELDS
from trainwarden.collector.ingest.steps import take_rows
from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import dialect_insert, upsert_columns
from trainwarden.collector.store.db import fetch_rows, is_sqlite

# Run ids never change once a run exists: remember them per database.
_run_ids: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()


def run_id_for(conn: Connection, *, name: str, world_size: int, now: float) -> int:
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
    stmt = dialect_insert(conn, m.runs).on_conflict_do_nothing(index_elements=["name"])
    conn.execute(
        stmt, {"name": name, "created_at": now, "updated_at": now, "world_size": world_size}
    )
    return int(conn.execute(query).scalar_one())


def forget_runs(engine: Engine) -> None:
    """Drop the cached run ids: after a failed transaction one may name a run never stored."""
    _run_ids.pop(engine, None)


_HEAD_COLUMNS = (*AGENT_FIELDS, "top", "arrived")  # a flush's headers: and each one's request's


def newest_heads(heads: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A run's headers in a flush with one row a rank: where a rank sent twice (two
    requests of a node in one flush), its newest header wins, with the highest step of
    both and the later arrival."""
    ranks = heads["rank"]
    if len(set(ranks)) == len(ranks):
        return heads
    last = {rank: i for i, rank in enumerate(ranks)}  # the newest: the later request
    top: dict[int, int] = {}
    for rank, step in zip(ranks, heads["top"], strict=True):
        if step is not None:
            top[rank] = max(step, top.get(rank, step))
    keep = sorted(last.values())
    out = take_rows(heads, keep)
    out["top"] = [top.get(rank) for rank in out["rank"]]
    return out


def track_ranks(
    conn: Connection,
    *,
    run_id: int,
    heads: dict[str, list[Any]],
    now: float,
    found: list[tuple[Any, ...]] | None = None,
) -> dict[int, int | None]:
    """Heartbeat and progress of the ranks in a flush, in a fixed number of statements
    whatever their number; a rank back with a new process session gets a ``restart``
    event. ``heads``: the ranks' headers column-wise (AgentInfo's fields, one row a
    rank), with ``top`` (each rank's highest step in the flush) and ``arrived`` (when its
    request came in). Returns each known rank's highest step stored before this flush
    (its ``high_step``: ``last_step`` goes back with a rollback, the high step does not).
    ``found``: :func:`known_ranks`' rows of these ranks, when the caller read them."""
    ranks, sessions, arrived = heads["rank"], heads["session"], heads["arrived"]
    if found is None:
        found = known_ranks(conn, run_id, ranks)
    # Rows unpacked as tuples: a Row's attribute access costs, and this runs every flush.
    at = dict(zip(ranks, range(len(ranks)), strict=True))
    previous: dict[int, int | None] = {}
    # A request that arrived before the rank's stored heartbeat is stale: with several
    # collectors, a rank's consecutive requests can commit out of order (one collector
    # behind another). It adds its steps but changes nothing of the rank (the upsert's
    # WHERE), and an old process's late request is no restart.
    restarts: list[tuple[int, str]] = []  # (row in heads, the previous session)
    for rank, session, _, seen, _, high, *_ in found:
        previous[rank] = high
        i = at[rank]
        if session != sessions[i] and arrived[i] >= seen:
            restarts.append((i, session))
    if restarts:
        restarts.sort(key=lambda pair: ranks[pair[0]])  # rank order, as the evaluator locks
        back = {ranks[i] for i, _ in restarts}
        attempts.record_lost(
            conn, [dict(zip(_FOUND, row[:5], strict=True)) for row in found if row[0] in back]
        )
        conn.execute(
            dialect_insert(conn, m.events).on_conflict_do_nothing(index_elements=["uid"]),
            [
                {
                    # Derived from both sessions so that a replayed batch cannot add it twice.
                    "uid": uuid.uuid5(uuid.NAMESPACE_OID, f"restart:{before}:{sessions[i]}").hex,
                    "run_id": run_id,
                    "rank": ranks[i],
                    "step": None,
                    "ts": heads["started_at"][i] or now,
                    "recv_ts": now,
                    "kind": "restart",
                    "severity": "warning",
                    "data": {
                        "previous_session": before,
                        "session": sessions[i],
                        "pid": heads["pid"][i],
                    },
                }
                for i, before in restarts
            ],
        )
    n = len(ranks)
    said = heads["last_step"]  # the header's own last step, or its steps here: the higher
    last_steps = [
        t if s is None else (s if t is None else max(s, t))
        for s, t in zip(said, heads["top"], strict=True)
    ]
    node = heads["node"]
    in_step = heads["in_step"]
    sent = heads["sent_at"]
    cols: dict[str, list[Any]] = {
        "run_id": [run_id] * n,
        "rank": ranks,
        "local_rank": heads["local_rank"],
        "host": heads["host"],
        "node": heads["host"]
        if node.count(None) == n
        else [v or h for v, h in zip(node, heads["host"], strict=True)],
        "pid": heads["pid"],
        "session": sessions,
        # Every request is a heartbeat, seen when it arrived (not when the writer got
        # to it: a busy collector must not make its ranks look dead).
        "first_seen": arrived,
        "last_seen": arrived,
        "last_step": last_steps,
        "high_step": last_steps,
        "state": ["healthy"] * n,
        "state_since": [now] * n,
        "heartbeat_s": heads["heartbeat_s"],
        "progress_at": heads["last_step_end"],  # none before the first step: no hung verdict yet
        "in_step": in_step
        if in_step.count(None) == n
        else [None if v is None else int(v) for v in in_step],
        "phase": heads["phase"],
        "clock_skew_s": [None if s is None else t - s for s, t in zip(sent, arrived, strict=True)],
    }
    upsert_columns(
        conn, m.ranks, cols, key=("run_id", "rank"), set_=_rank_update, where=_newer_heartbeat
    )
    return previous


_FOUND = ("rank", "session", "last_step", "last_seen", "progress_at")  # track_ranks' read


_KNOWN = (
    "rank",
    "session",
    "last_step",
    "last_seen",
    "progress_at",
    "coalesce(high_step, last_step)",
    # For claims.check: whether the holder of a rank another session claims is alive.
    "heartbeat_s",
    "state",
    "pid",
    "host",
    "node",
    "first_seen",
)
# One index probe a rank of the flush whatever PostgreSQL's statistics say: the LIMIT keeps
# the lateral subquery from being flattened into a join the planner may reorder. As
# ``rank IN (SELECT unnest(:ranks))`` (until 2026-11-27), a table never analyzed (or
# analyzed before the run existed) was estimated at one row for the run, and the planner
# rescanned the array for each of its ranks: at 1,024 ranks a third of PostgreSQL's time,
# 15-40 ms a flush; now about 1 ms.
_KNOWN_SQL = text(
    f"SELECT k.* FROM unnest(CAST(:ranks AS INTEGER[])) AS u(rank) CROSS JOIN LATERAL "
    f"(SELECT {', '.join(_KNOWN)} FROM ranks "
    f"WHERE run_id = :run_id AND rank = u.rank LIMIT 1) AS k"
)


def known_ranks(conn: Connection, run_id: int, ranks: list[int]) -> list[tuple[Any, ...]]:
    """The stored rows of those of ``ranks`` the run has (:data:`_KNOWN`'s columns)."""
    if not is_sqlite(conn):
        return fetch_rows(conn, _KNOWN_SQL.bindparams(ranks=ranks, run_id=run_id))
    rk = m.ranks.c
    return fetch_rows(
        conn,
        select(
            rk.rank,
            rk.session,
            rk.last_step,
            rk.last_seen,
            rk.progress_at,
            func.coalesce(rk.high_step, rk.last_step),
            rk.heartbeat_s,
            rk.state,
            rk.pid,
            rk.host,
            rk.node,
            rk.first_seen,
        ).where(rk.run_id == run_id, rk.rank.in_(ranks)),
    )


def _newer_heartbeat(table: Any, new: Any) -> Any:
    """A rank's row is updated by a request that arrived at or after its stored heartbeat."""
    return table.c.last_seen <= new.last_seen


def _higher(a: Any, b: Any) -> Any:
    """The higher of two values, either of which may be NULL (GREATEST on both databases:
    SQLite's two-argument max() is NULL when either is)."""
    return case((a.is_(None), b), (b.is_(None), a), (a >= b, a), else_=b)


def _rank_update(table: Any, new: Any) -> dict[str, Any]:
    """How a heartbeat updates a known rank: ``new`` is the incoming row (EXCLUDED)."""
    old = table.c
    renewed = old.session != new.session  # a new process: healthy until the evaluator says not
    return {
        # The gap since its last request; none for a new process (its gap is the restart).
        "arrival_gap_s": case((renewed, null()), else_=new.last_seen - old.last_seen),
        **{
            c: new[c]
            for c in (
                "local_rank",
                "host",
                "node",
                "pid",
                "last_seen",
                "heartbeat_s",
                "in_step",
                "phase",
                "clock_skew_s",
                "session",
            )
        },
        "last_step": func.coalesce(new.last_step, old.last_step),
        "high_step": _higher(func.coalesce(old.high_step, old.last_step), new.high_step),
        "progress_at": func.coalesce(new.progress_at, old.progress_at),
        "state": case((renewed, "healthy"), else_=old.state),
        "state_since": case((renewed, new.state_since), else_=old.state_since),
        "state_detail": case((renewed, null()), else_=old.state_detail),
    }
