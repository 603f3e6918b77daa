"""A run's attempts (each launch: when, how it ended, its processes) and identity (code,
config, environment and packages of an attempt), and the diff between two runs."""

from __future__ import annotations

import math
import time
from typing import Any

from sqlalchemy import Connection, select

from trainwarden.collector.ingest import endings
from trainwarden.collector.read.queries import run_id_of
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import EvictPlan
from trainwarden.collector.store.errors import NotFound

_ENV_PER_HOST = ("host",)  # differs between any two runs on different machines: not news


def run_row(conn: Connection, run: str) -> Any:
    r = m.runs.c
    return conn.execute(
        select(r.id, r.name, r.created_at, r.updated_at, r.world_size, r.last_step, r.status).where(
            r.name == run
        )
    ).first()


def attempts(conn: Connection, run_id: int, *, now: float | None = None) -> list[dict[str, Any]]:
    """The run's attempts, oldest first, each with its processes, span and exit reason."""
    now = time.time() if now is None else now
    a, s, k = m.attempts.c, m.attempt_sessions.c, m.ranks.c
    rows = conn.execute(
        select(a.number, a.key, a.started_at, a.world_size, a.nodes, a.packages_hash)
        .where(a.run_id == run_id)
        .order_by(a.number)
    ).all()
    sessions = conn.execute(
        select(m.attempt_sessions)
        .where(s.run_id == run_id)
        .order_by(s.attempt, s.rank, s.started_at)
    ).all()
    # The processes still current in the ranks table: their heartbeats and states.
    current = {
        r.session: r
        for r in conn.execute(
            select(
                k.session, k.last_seen, k.last_step, k.progress_at, k.state, k.state_detail
            ).where(k.run_id == run_id)
        )
    }
    ac = m.actions.c
    evictions = [
        (evicted_at, action_id, node, trigger)
        for action_id, node, trigger, plan in conn.execute(
            select(ac.id, ac.node, ac.trigger, ac.plan).where(
                ac.run_id == run_id, ac.kind == "evict", ac.state == "done"
            )
        )
        if (evicted_at := EvictPlan.of(plan).evicted_at) is not None
    ]
    out = []
    for i, row in enumerate(rows):
        mine = [x for x in sessions if x.attempt == row.number]
        procs = []
        for x in mine:
            live = current.get(x.session)
            last_seen = (
                x.last_seen if x.last_seen is not None else (live.last_seen if live else None)
            )
            last_step = (
                x.last_step if x.last_step is not None else (live.last_step if live else None)
            )
            last_end = (
                x.last_step_end
                if x.last_step_end is not None
                else (live.progress_at if live else None)
            )
            reason, detail = x.end_reason, x.end_detail
            if reason is None and live is not None and live.state in ("dead", "failed"):
                reason = "lost" if live.state == "dead" else "exception"
                detail = (
                    (live.state_detail or {}).get("reason")
                    if isinstance(live.state_detail, dict)
                    else None
                )
            procs.append(
                {
                    "rank": x.rank,
                    "host": x.host,
                    "session": x.session,
                    "started_at": x.started_at,
                    "first_step": x.first_step,
                    "first_step_at": x.first_step_at,
                    "last_step": last_step,
                    "last_step_end": last_end,
                    "last_seen": last_seen,
                    "ended_at": x.ended_at,
                    "end_reason": reason,
                    "end_detail": detail,
                    "exit_code": x.exit_code,
                }
            )
        later = i + 1 < len(rows)
        ended = [p for p in procs if p["end_reason"] is not None]
        done = bool(procs) and (later or len(ended) == len(procs))
        reason, detail = _exit(procs) if done else (None, None)
        ends = [p["last_seen"] for p in procs if p["last_seen"] is not None]
        if done and reason != "completed":
            # A node evicted while it ran ended it: that is the cause, whatever the
            # processes saw (the scheduler's SIGTERM, a lost peer).
            until = rows[i + 1].started_at if later else (max(ends) if ends else now)
            hit = [e for e in evictions if row.started_at <= e[0] <= until]
            if hit:
                at, action_id, node, trigger = min(hit)
                reason, detail = (
                    "evicted",
                    f"node {node} evicted by action {action_id} ({trigger}); then {detail}",
                )
        outcome = detail_of = None
        if done:  # the newest attempt's ranks still hold its verdict; an earlier one's do not
            outcome, detail_of = (
                endings.run_outcome(conn, run_id)
                if not later
                else endings.outcome(
                    [p["end_reason"] for p in procs], failed=reason in ("exception", "evicted")
                )
            )
        firsts = [p["first_step"] for p in procs if p["first_step"] is not None]
        lasts = [p["last_step"] for p in procs if p["last_step"] is not None]
        out.append(
            {
                "number": row.number,
                "key": row.key,
                "started_at": row.started_at,
                "ended_at": max(ends) if done and ends else None,
                "state": "ended" if done else "running",
                "exit_reason": reason,
                "exit_detail": detail,
                "outcome": outcome,
                "outcome_detail": detail_of,
                "world_size": row.world_size,
                "nodes": list(row.nodes or []),
                "first_step": min(firsts) if firsts else None,
                "last_step": max(lasts) if lasts else None,
                "packages_hash": row.packages_hash,
                "processes": procs,
            }
        )
    return out


def _exit(procs: list[dict[str, Any]]) -> tuple[str, str]:
    """An ended attempt's reason: its first failure (an exception, or a process gone
    without a goodbye) by time, the cause, rather than what it did to the others; else
    a signal or a stop; else completed."""

    def when(p: dict[str, Any]) -> float:
        return p["ended_at"] or p["last_seen"] or math.inf

    for reasons in (("exception", "lost", None), ("sigterm", "stopped")):
        hits = [p for p in procs if p["end_reason"] in reasons]
        if hits:
            first = min(hits, key=when)
            break
    else:
        return "completed", f"all {len(procs)} processes completed"
    reason = first["end_reason"] or "lost"
    what = first["end_detail"] or (
        "ended without a goodbye (crash, kill or node loss)" if reason == "lost" else reason
    )
    where = f"rank {first['rank']}" + (f" on {first['host']}" if first["host"] else "")
    at = "" if first["last_step"] is None else f" at step {first['last_step']}"
    others = sorted({p["end_reason"] or "lost" for p in procs if p is not first})
    tail = f" (then: {', '.join(others)})" if others else ""
    return reason, f"{where}{at}: {what}{tail}"


def identity(conn: Connection, run_id: int, attempt: int | None = None) -> dict[str, Any] | None:
    """Config, tags, data snapshot, code and environment of an attempt (default: newest)."""
    a = m.attempts.c
    query = select(
        a.number,
        a.config,
        a.tags,
        a.data_snapshot,
        a.code,
        a.env,
        a.packages_hash,
        a.world_size,
        a.nodes,
    ).where(a.run_id == run_id)
    query = (
        query.where(a.number == attempt) if attempt is not None else query.order_by(a.number.desc())
    )
    row = conn.execute(query.limit(1)).first()
    if row is None:
        return None
    return {
        "attempt": row.number,
        "config": row.config,
        "tags": row.tags or [],
        "data_snapshot": row.data_snapshot,
        "code": row.code,
        "env": row.env,
        "packages_hash": row.packages_hash,
        "world_size": row.world_size,
        "nodes": list(row.nodes or []),
    }


def packages(conn: Connection, run_id: int, attempt: int | None = None) -> list[str] | None:
    """The installed packages rank 0 reported (``name==version``)."""
    a = m.attempts.c
    query = select(a.packages).where(a.run_id == run_id, a.packages.is_not(None))
    query = (
        query.where(a.number == attempt) if attempt is not None else query.order_by(a.number.desc())
    )
    found = conn.execute(query.limit(1)).first()
    return None if found is None else list(found[0])


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, inner in value.items():
            out.update(_flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def _changes(a: Any, b: Any) -> list[dict[str, Any]]:
    fa, fb = _flatten(a or {}), _flatten(b or {})
    return [
        {"key": key, "a": fa.get(key), "b": fb.get(key)}
        for key in sorted(set(fa) | set(fb))
        if fa.get(key) != fb.get(key) and key not in _ENV_PER_HOST
    ]


def _versions(found: list[str]) -> dict[str, str]:
    out = {}
    for line in found:
        name, _, version = line.partition("==")
        out[name] = version
    return out


def diff(conn: Connection, run_a: int, run_b: int) -> dict[str, Any]:
    """What differs between two runs' newest attempts: config (dotted keys), code,
    environment, tags, data snapshot, installed packages."""
    ia, ib = identity(conn, run_a) or {}, identity(conn, run_b) or {}
    out: dict[str, Any] = {
        "config": _changes(ia.get("config"), ib.get("config")),
        "code": _changes(ia.get("code"), ib.get("code")),
        "env": _changes(ia.get("env"), ib.get("env")),
        "tags": {
            "only_a": sorted(set(ia.get("tags") or []) - set(ib.get("tags") or [])),
            "only_b": sorted(set(ib.get("tags") or []) - set(ia.get("tags") or [])),
        },
        "data_snapshot": None
        if ia.get("data_snapshot") == ib.get("data_snapshot")
        else {"a": ia.get("data_snapshot"), "b": ib.get("data_snapshot")},
        "world_size": None
        if ia.get("world_size") == ib.get("world_size")
        else {"a": ia.get("world_size"), "b": ib.get("world_size")},
    }
    pa, pb = packages(conn, run_a), packages(conn, run_b)
    if pa is not None and pb is not None:
        va, vb = _versions(pa), _versions(pb)
        out["packages"] = {
            "added": sorted(f"{n}=={vb[n]}" for n in set(vb) - set(va)),
            "removed": sorted(f"{n}=={va[n]}" for n in set(va) - set(vb)),
            "changed": [
                {"name": n, "a": va[n], "b": vb[n]}
                for n in sorted(set(va) & set(vb))
                if va[n] != vb[n]
            ],
        }
    elif ia.get("packages_hash") != ib.get("packages_hash"):
        out["packages"] = {"hash_a": ia.get("packages_hash"), "hash_b": ib.get("packages_hash")}
    else:
        out["packages"] = None
    pkg = out["packages"]
    out["identical"] = not any(
        out[k] for k in ("config", "code", "env", "data_snapshot", "world_size")
    ) and not (out["tags"]["only_a"] or out["tags"]["only_b"] or (pkg and any(pkg.values())))
    return out


def run_attempts(conn: Connection, *, run: str) -> list[dict[str, Any]]:
    """``GET /api/v1/runs/{run}/attempts``: every process lifetime of the run, oldest first."""
    return attempts(conn, run_id_of(conn, run))


def run_identity(conn: Connection, *, run: str, attempt: int | None = None) -> dict[str, Any]:
    """The identity of the run's newest attempt (or of ``attempt``); NotFound without one."""
    found = identity(conn, run_id_of(conn, run), attempt)
    if found is None:
        raise NotFound(
            f"run {run!r} has no identity{'' if attempt is None else f' for attempt {attempt}'}: "
            "its agents sent no attempt_start (trainwarden < 0.11?)"
        )
    return found


def run_packages(conn: Connection, *, run: str, attempt: int | None = None) -> list[str]:
    """The installed packages rank 0 reported; NotFound without a list."""
    found = packages(conn, run_id_of(conn, run), attempt)
    if found is None:
        raise NotFound(f"run {run!r} reported no package list")
    return found


def run_diff(conn: Connection, *, a: str, b: str) -> dict[str, Any]:
    """What differs between runs ``a`` and ``b``."""
    return {"a": a, "b": b, **diff(conn, run_id_of(conn, a), run_id_of(conn, b))}
