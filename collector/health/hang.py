"""Hung collectives, live: ask a hung run's ranks for their Flight Recorder rings,
decide who never arrived (:mod:`.collectives`), and keep the verdict.

- As soon as the health evaluator holds a rank of a run hung, every rank of the run gets
  a ``collectives`` command (on its next ingest answer; :func:`request`, also what an
  operator's ``POST /api/v1/runs/{run}/collectives`` does). The agents answer from their
  exporter thread with a ``collectives`` event; a rank whose own training thread stalled
  has usually sent one already.
- Each evaluation of a run with hung ranks lines up the newest ring of each rank (sent
  since shortly before the hang began) and, when the verdict changed, stores it as a
  ``hang_verdict`` event (the timeline and the post-mortem show it) and names it in the
  hung ranks' state details (``collective``), which the ``RankHung`` alert carries in its
  description and annotations; a dead culprit's details too, which ``RankDead`` carries.
- A look that reads less than an earlier one of the same hang (``incomplete``: a
  member's ring not in yet or left out; ``no_data``) does not replace the culprit that
  earlier rings named: it stands until rings that are read say otherwise.
"""

from __future__ import annotations

import weakref
from typing import Any

from sqlalchemy import Connection, Engine, and_, func, insert, select, update

from trainwarden.collector.health.collectives import analyze, table, with_crashes
from trainwarden.collector.ingest import crashes
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.store import models as m

REQUEST_TTL_S = 30.0
"""A request is sent to the ranks (on every ingest answer) for this long."""
RING_LEAD_S = 60.0
"""A ring dumped this long before the hang began counts (a rank that stalled dumps its
own, at the same threshold as the evaluator's)."""
VIEW_WINDOW_S = 600.0
"""The view shows each rank's newest ring within this long of the newest one."""

# Per database and run: the last verdict stored (the hang's start, its summary), and the
# last one decided with what it was decided on (a run of thousands of ranks is not read
# and lined up again each second while no new ring came).
_stored: weakref.WeakKeyDictionary[Engine, dict[int, tuple[float, str]]] = (
    weakref.WeakKeyDictionary()
)
_decided: weakref.WeakKeyDictionary[Engine, dict[int, tuple[Any, dict[str, Any]]]] = (
    weakref.WeakKeyDictionary()
)
# Per database and run: the newest verdict of the hang that named culprits (a culprit or
# a desync). A later look that reads less (a ring not in yet, one left out) does not
# undo it: what was read stands until rings that are read say otherwise.
_named: weakref.WeakKeyDictionary[Engine, dict[int, dict[str, Any]]] = weakref.WeakKeyDictionary()
LESS_READ = ("incomplete", "no_data")
"""Verdicts that say what could not be read, not what happened."""


def request(
    conn: Connection, *, run: str, by: str, now: float, reason: str = "", board: Any = None
) -> dict[str, Any]:
    """Ask every rank of ``run`` for its collectives now. ``board``: the collector's
    :class:`~trainwarden.collector.actions.commands.CommandBoard`, told at once."""
    row = conn.execute(select(m.runs.c.id, m.runs.c.world_size).where(m.runs.c.name == run)).first()
    if row is None:
        raise NotFound(f"run {run!r} not found")
    ranks = _ask(conn, run_id=row.id, world=row.world_size, by=by, now=now, reason=reason)
    if board is not None:
        board.runs.add(run)
    return {"run": run, "requested_at": now, "ranks": ranks}


def _ask(conn: Connection, *, run_id: int, world: int, by: str, now: float, reason: str) -> int:
    ranks = list(
        conn.execute(select(m.ranks.c.rank).where(m.ranks.c.run_id == run_id)).scalars()
    ) or list(range(world))
    body = {"type": "collectives", "by": by, "reason": reason}
    conn.execute(
        insert(m.agent_commands),
        [
            {"action_id": None, "run_id": run_id, "rank": r, "body": body, "created_at": now}
            for r in sorted(ranks)
        ],
    )
    return len(ranks)


def _requested_since(conn: Connection, run_id: int, since: float) -> bool:
    c = m.agent_commands.c
    return (
        conn.execute(
            select(c.id)
            .where(c.run_id == run_id, c.action_id.is_(None), c.created_at >= since)
            .limit(1)
        ).first()
        is not None
    )


def close_requests(conn: Connection, now: float) -> int:
    """Stop sending requests older than :data:`REQUEST_TTL_S` (an agent answers each once)."""
    c = m.agent_commands.c
    return conn.execute(
        update(m.agent_commands)
        .where(c.action_id.is_(None), c.done_at.is_(None), c.created_at < now - REQUEST_TTL_S)
        .values(done_at=now)
    ).rowcount


def rings(
    conn: Connection, run_id: int, since: float, *, stalled: bool = False
) -> dict[int, tuple[float, dict[str, Any]]]:
    """Each rank's newest ``collectives`` event since ``since``: rank -> (time, data).
    ``stalled``: only rings dumped since the rank's last step ended (on its own clock); one
    from before it made progress again tells of an earlier hang, not of this one."""
    e, k = m.events.c, m.ranks.c
    where = [e.run_id == run_id, e.kind == "collectives", e.ts >= since, e.rank.is_not(None)]
    if stalled:
        progressed = (
            select(func.coalesce(k.progress_at, 0.0))
            .where(k.run_id == e.run_id, k.rank == e.rank)
            .scalar_subquery()
        )
        where.append(e.ts >= func.coalesce(progressed, 0.0))
    newest = select(e.rank, func.max(e.id).label("id")).where(*where).group_by(e.rank).subquery()
    rows = conn.execute(
        select(e.rank, e.ts, e.data).join(newest, and_(e.id == newest.c.id, e.run_id == run_id))
    ).all()
    return {int(r.rank): (float(r.ts), dict(r.data or {})) for r in rows}


def earlier_rings(conn: Connection, run_id: int) -> dict[int, dict[str, Any]]:
    """Each rank's ``collectives`` event before its newest, sent since the run's current
    attempt began (a restarted process numbers its collectives from 1 again): rank ->
    data. What a newer ring's sequence ids may not go back from."""
    e, a = m.events.c, m.attempts.c
    began = select(func.max(a.started_at)).where(a.run_id == run_id).scalar_subquery()
    numbered = (
        select(
            e.rank,
            e.data,
            func.row_number().over(partition_by=e.rank, order_by=e.id.desc()).label("nth"),
        )
        .where(
            e.run_id == run_id,
            e.kind == "collectives",
            e.rank.is_not(None),
            e.ts >= func.coalesce(began, 0.0),
        )
        .subquery()
    )
    rows = conn.execute(select(numbered.c.rank, numbered.c.data).where(numbered.c.nth == 2))
    return {int(r.rank): dict(r.data or {}) for r in rows}


def briefs(
    conn: Connection, run_id: int, ranks: list[int] | None = None
) -> dict[int, dict[str, Any]]:
    """What the run's crashed ranks (of their current session) died of: rank -> brief."""
    return {
        rank: crashes.brief(rank, data, data.get("at"))
        for rank, data in crashes.current(conn, run_id, ranks).items()
    }


def _nodes(conn: Connection, run_id: int) -> dict[int, str | None]:
    k = m.ranks.c
    return {
        r.rank: r.node or r.host
        for r in conn.execute(select(k.rank, k.node, k.host).where(k.run_id == run_id))
    }


def refine(
    conn: Connection,
    *,
    run_id: int,
    world: int,
    ranks: list[Any],
    states: dict[int, tuple[str, dict[str, Any]]],
    dead: list[int],
    now: float,
    board: Any = None,
    run: str | None = None,
) -> list[dict[str, Any]]:
    """For a run with hung ranks: ask for rings once per hang, decide on what arrived, and
    put the verdict in the hung ranks' details (``states``, changed in place). Returns the
    events to store (a ``hang_verdict`` when it changed)."""
    hung = {rank for rank, (state, _) in states.items() if state == "hung"}
    if not hung:
        forget(conn.engine, run_id)
        return []
    since = {r["rank"]: r["state_since"] for r in ranks if r["state"] == "hung"}
    start = min((since.get(rank) or now for rank in hung), default=now)
    if not _requested_since(conn, run_id, start - 1.0):
        _ask(conn, run_id=run_id, world=world, by="health", now=now, reason="a rank is hung")
        if board is not None and run is not None:
            board.runs.add(run)
    e = m.events.c
    # The newest id and how many: on PostgreSQL a ring may commit after one with a higher
    # id (ids are taken at insert, not at commit), and the count still sees it.
    newest = conn.execute(
        select(func.max(e.id), func.count()).where(
            e.run_id == run_id, e.kind == "collectives", e.ts >= start - RING_LEAD_S
        )
    ).one()
    if newest[0] is None:
        return []
    crashed = briefs(conn, run_id, dead) if dead else {}
    key = (start, tuple(newest), tuple(sorted(dead)), tuple(sorted(crashed)))
    decided = _decided.setdefault(conn.engine, {})
    if run_id in decided and decided[run_id][0] == key:
        verdict = decided[run_id][1]
    else:
        got = rings(conn, run_id, start - RING_LEAD_S, stalled=True)
        nodes = _nodes(conn, run_id)
        verdict = analyze(
            {r: data for r, (_, data) in got.items()},
            world=world,
            nodes=nodes,
            dead=dead,
            earlier=earlier_rings(conn, run_id),
        )
        verdict = with_crashes(verdict, crashed, nodes=nodes) or verdict
        verdict["hang_started"] = start
        named = _named.setdefault(conn.engine, {})
        if verdict["kind"] in ("culprit", "desync"):
            named[run_id] = verdict
        elif verdict["kind"] in LESS_READ and run_id in named:
            verdict = named[run_id]
        decided[run_id] = (key, verdict)
    _apply(verdict, states)
    _blame_unread_dead(conn, run_id, verdict, states)
    stored = _stored.setdefault(conn.engine, {})
    started = verdict["hang_started"]
    if stored.get(run_id) == (started, verdict["summary"]):
        return []
    stored[run_id] = (started, verdict["summary"])
    culprits = verdict["culprits"]
    return [
        {
            "rank": culprits[0] if len(culprits) == 1 else None,
            "kind": "hang_verdict",
            "severity": "critical" if verdict["kind"] in ("culprit", "desync") else "warning",
            "uid": f"hang_verdict:{run_id}:{started}:{verdict['summary']}",
            "step": max(
                (r["last_step"] for r in ranks if r["last_step"] is not None), default=None
            ),
            "data": verdict,
        }
    ]


def forget(engine: Engine, run_id: int) -> None:
    """The run has no hung rank (any more): what was decided of its hang is over."""
    for kept in (_stored, _decided, _named):
        kept.get(engine, {}).pop(run_id, None)


def _apply(verdict: dict[str, Any], states: dict[int, tuple[str, dict[str, Any]]]) -> None:
    """The verdict names culprits and victims: the hung ranks' details say so."""
    if verdict["kind"] not in ("culprit", "desync"):
        for state, detail in states.values():
            if state == "hung":
                detail["collective"] = verdict["summary"]
        return
    culprits = verdict["culprits"]
    where = (
        f"{verdict['op']} #{verdict['seq']} on pg {verdict['group']['pg']}"
        if verdict.get("group")
        else "a collective"
    )
    since = verdict.get("hang_started")
    for rank, (state, detail) in states.items():
        if state == "dead" and rank in culprits:  # RankDead's alert carries it (no ring)
            detail.update(role="culprit", collective=verdict["summary"], since=since)
            detail.pop("waiting_on", None)
            continue
        if state != "hung":
            continue
        detail.update(collective=verdict["summary"], since=since)
        if rank in culprits:
            detail.update(role="culprit", reason=verdict["summary"])
            detail.pop("waiting_on", None)
        else:
            detail.update(
                role="victim",
                waiting_on=culprits,
                reason=f"waits in {where} on rank(s) {culprits}",
            )


def _blame_unread_dead(
    conn: Connection,
    run_id: int,
    verdict: dict[str, Any],
    states: dict[int, tuple[str, dict[str, Any]]],
) -> None:
    """A dead culprit the evaluator no longer reads (silent since it was found dead: not
    in ``states``) gets the verdict in its details too, written here: the ``RankDead``
    alert carries it, as ``RankHung`` does a hung culprit's."""
    if verdict["kind"] not in ("culprit", "desync"):
        return
    unread = sorted(set(verdict["culprits"]) & set(verdict.get("dead") or ()) - set(states))
    if not unread:
        return
    k = m.ranks.c
    rows = conn.execute(
        select(k.rank, k.state_detail).where(
            k.run_id == run_id, k.rank.in_(unread), k.state == "dead"
        )
    ).all()
    for rank, detail in rows:
        detail = dict(detail or {})
        if detail.get("collective") == verdict["summary"]:
            continue
        detail.update(role="culprit", collective=verdict["summary"])
        conn.execute(
            update(m.ranks)
            .where(k.run_id == run_id, k.rank == rank, k.state == "dead")
            .values(state_detail=detail)
        )


def view(conn: Connection, *, run: str, now: float) -> dict[str, Any]:
    """What the API and the UI show: the newest rings, the verdict on them, the table."""
    row = conn.execute(select(m.runs.c.id, m.runs.c.world_size).where(m.runs.c.name == run)).first()
    if row is None:
        raise NotFound(f"run {run!r} not found")
    e, c = m.events.c, m.agent_commands.c
    newest = conn.execute(
        select(func.max(e.ts)).where(e.run_id == row.id, e.kind == "collectives")
    ).scalar()
    got = rings(conn, row.id, newest - VIEW_WINDOW_S) if newest is not None else {}
    requested = conn.execute(
        select(func.max(c.created_at)).where(c.run_id == row.id, c.action_id.is_(None))
    ).scalar()
    nodes = _nodes(conn, row.id)
    dead = list(
        conn.execute(
            select(m.ranks.c.rank).where(m.ranks.c.run_id == row.id, m.ranks.c.state == "dead")
        ).scalars()
    )
    data = {r: d for r, (_, d) in got.items()}
    verdict = None
    if data:
        earlier = earlier_rings(conn, row.id)
        verdict = analyze(data, world=row.world_size, nodes=nodes, dead=dead, earlier=earlier)
    # A rank that died of a signal (its last words, sent by a survivor of its node).
    crashed = briefs(conn, row.id)
    verdict = with_crashes(verdict, crashed, nodes=nodes)
    if verdict is not None:
        verdict["at"] = now
    stored = conn.execute(
        select(e.ts)
        .where(e.run_id == row.id, e.kind == "hang_verdict")
        .order_by(e.id.desc())
        .limit(1)
    ).first()
    return {
        "run": run,
        "requested_at": requested,
        "stored_at": stored.ts if stored else None,
        "verdict": verdict,
        "groups": table(data, verdict, world=row.world_size, nodes=nodes),
        "crashes": {str(r): c for r, c in sorted(crashed.items())},
        "rings": {
            str(r): {
                "at": ts,
                "trigger": d.get("trigger"),
                "available": bool(d.get("available")),
                "reason": d.get("reason"),
            }
            for r, (ts, d) in sorted(got.items())
        },
    }
