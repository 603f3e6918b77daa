"""Run identity and run economics: attempts, checkpoints, goodput and the cadence advisor.

Everything here is computed on read from what is stored (attempts, attempt sessions,
step rollups, checkpoint events, rollback actions): nothing is kept twice.

**Goodput.** The allocation is the run's GPUs times the wall-clock time since its first
attempt started (until now, or the run's end), with each stretch counted at the world
size of the attempt that held it. Of those GPU-seconds:

- *kept*: step time of the steps whose results were kept (the stored executions: a step
  run again after a restart or rollback replaces the earlier one), summed over ranks;
- *replayed*: work done and then thrown away: a process that failed ran steps past the
  checkpoint its successor resumed from (from the end of the last kept step to the end of
  its last step), and an in-process rollback re-runs the steps since its checkpoint;
- *recovery*: from the last step of a failed attempt to the first step of the next;
- *checkpoint*: blocking save time, as ``tw.checkpoint_saved(seconds=...)`` reported it;
- *data wait*: the gaps between steps, less the checkpoint saves that sat in them;
- *other*: what is left (start-up, evaluation, logging, idle).

ETTR (effective training time ratio) = kept / allocation.

**Cadence advisor.** With C the median blocking save cost and tau the mean time between
interruptions, the expected waste per unit of time at a checkpoint interval T is
``C/T + (T + C)/(2 tau)`` (saving, and on average half an interval plus a save lost per
failure), minimised at ``T* = sqrt(2 C tau)``. tau is the run's own when it has had at
least :data:`MIN_FAILURES` interruptions, else the configured MTBF.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from trainwarden.collector.store import models as m

MIN_FAILURES = 2
"""Interruptions a run needs before its own rate replaces the configured MTBF."""
GPU_MTBF_HOURS = 50_000.0
"""Default per-GPU mean time between failures (reference 004: ~50,000 h per GPU): a
job of N GPUs is interrupted every 50,000 / N hours when nothing better is known."""
OFF_BY = 2.0
"""The advisor calls an interval off when it is more than this factor from T*."""
FAILED_ENDS = ("exception", "lost", "sigterm", "evicted")
"""How a process ended that counts as an interruption (``completed`` / ``stopped`` don't)."""


@dataclass(frozen=True)
class EconomicsSettings:
    """``serve --price-per-gpu-hour``, ``--mtbf-hours`` (the job's), ``--gpu-mtbf-hours``."""

    price_per_gpu_hour: float | None = None
    mtbf_hours: float | None = None
    gpu_mtbf_hours: float = GPU_MTBF_HOURS


# -- attempts --------------------------------------------------------------------------


def _run_row(conn: Connection, run: str) -> Any:
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
        (plan["evicted_at"], action_id, node, trigger)
        for action_id, node, trigger, plan in conn.execute(
            select(ac.id, ac.node, ac.trigger, ac.plan).where(
                ac.run_id == run_id, ac.kind == "evict", ac.state == "done"
            )
        )
        if isinstance(plan, dict) and isinstance(plan.get("evicted_at"), (int, float))
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


# -- identity and diff --------------------------------------------------------------------


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


_ENV_PER_HOST = ("host",)  # differs between any two runs on different machines: not news


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


# -- checkpoints ---------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def checkpoint_stats(conn: Connection, run_id: int) -> dict[str, Any]:
    """Per run: count, last, interval (steps and seconds, medians), blocking cost C
    (median over checkpoints of the slowest rank's save), bytes, async drain time."""
    e = m.events.c
    by_step: dict[int, dict[str, Any]] = {}
    for step, ts, kind, data in conn.execute(
        select(e.step, e.ts, e.kind, e.data)
        .where(
            e.run_id == run_id,
            e.kind.in_(("checkpoint", "checkpoint_drained")),
            e.step.is_not(None),
        )
        .order_by(e.ts)
    ):
        data = data if isinstance(data, dict) else {}
        c = by_step.setdefault(
            step,
            {
                "step": step,
                "ts": ts,
                "seconds": None,
                "bytes": None,
                "drain_seconds": None,
                "path": None,
            },
        )
        if kind == "checkpoint":
            c["ts"] = min(c["ts"], ts)
            c["path"] = c["path"] or data.get("path")
            for field in ("seconds", "bytes"):
                value = _number(data.get(field))
                if value is not None:
                    c[field] = value if c[field] is None else max(c[field], value)
        value = _number(data.get("drain_seconds"))
        if value is not None:
            c["drain_seconds"] = (
                value if c["drain_seconds"] is None else max(c["drain_seconds"], value)
            )
    saved = sorted(by_step.values(), key=lambda c: c["ts"])
    blocking = [c["seconds"] for c in saved if c["seconds"] is not None]
    steps, seconds = [], []
    for before, after in zip(saved, saved[1:], strict=False):
        if after["step"] > before["step"]:  # not across a rollback or a restart's resume
            steps.append(after["step"] - before["step"])
            seconds.append(after["ts"] - before["ts"])
    sizes = [c["bytes"] for c in saved if c["bytes"] is not None]
    drains = [c["drain_seconds"] for c in saved if c["drain_seconds"] is not None]
    last = saved[-1] if saved else None
    return {
        "count": len(saved),
        "last": None
        if last is None
        else {k: last[k] for k in ("step", "ts", "path", "seconds", "bytes")},
        "interval_steps": statistics.median(steps) if steps else None,
        "interval_s": statistics.median(seconds) if seconds else None,
        "blocking_s": statistics.median(blocking) if blocking else None,
        "blocking_total_s": sum(blocking),
        "bytes": statistics.median(sizes) if sizes else None,
        "drain_s": statistics.median(drains) if drains else None,
        "_by_step": saved,
    }


# -- goodput -----------------------------------------------------------------------------------


def _rank_seconds(conn: Connection, run_id: int, metric: str) -> tuple[float, int]:
    """Σ over stored steps and ranks of a step rollup (mean × ranks), and the steps."""
    s = m.step_stats.c
    total, steps = conn.execute(
        select(func.sum(s.mean * (s.n - s.nonfinite)), func.count()).where(
            s.run_id == run_id, s.metric == metric, s.mean.is_not(None)
        )
    ).one()
    return float(total or 0.0), int(steps or 0)


def _step_ends(conn: Connection, run_id: int, step: int) -> dict[int, tuple[float, float]]:
    """Each rank's stored execution of ``step``: rank -> (start, end), in one query."""
    r = m.rank_steps.c
    rows = conn.execute(
        select(r.rank, r.ts, r.duration_s).where(r.run_id == run_id, r.step == step)
    )
    return {rank: (float(ts), float(ts + d)) for rank, ts, d in rows}


def _restored_step(plan: dict[str, Any], result: dict[str, Any] | None) -> int | None:
    """The checkpoint step a done rollback went back to: what the ranks restored (the
    result), else what was planned. (The plan's own top-level ``checkpoint_step`` is only
    an operator's choice, None when a rule asked for the rollback.)"""
    restored = {
        r.get("checkpoint_step")
        for r in ((result or {}).get("ranks") or {}).values()
        if isinstance(r, dict)
    }
    steps = [s for s in restored if isinstance(s, int)]
    if steps:
        return min(steps)
    planned = (plan.get("rollback") or {}).get("checkpoint_step", plan.get("checkpoint_step"))
    return planned if isinstance(planned, int) else None


def goodput(
    conn: Connection,
    run_id: int,
    *,
    settings: EconomicsSettings | None = None,
    now: float | None = None,
    tries: list[dict[str, Any]] | None = None,
    checkpoints: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """ETTR and where the rest of the allocation went (GPU-seconds, see the module doc)."""
    settings = settings or EconomicsSettings()
    now = time.time() if now is None else now
    run = conn.execute(
        select(
            m.runs.c.created_at, m.runs.c.updated_at, m.runs.c.world_size, m.runs.c.status
        ).where(m.runs.c.id == run_id)
    ).one()
    tries = attempts(conn, run_id, now=now) if tries is None else tries
    checkpoints = checkpoint_stats(conn, run_id) if checkpoints is None else checkpoints
    start = tries[0]["started_at"] if tries else run.created_at
    finished = run.status in ("finished", "failed") or (tries and tries[-1]["state"] == "ended")
    if finished:
        ends = [t["ended_at"] for t in tries if t["ended_at"] is not None]
        end = max([run.updated_at, *ends]) if not tries else max(ends, default=run.updated_at)
    else:
        end = now
    # Allocation: each stretch at the world size of the attempt that held it.
    allocation = 0.0
    spans = []
    for i, t in enumerate(tries):
        t_end = tries[i + 1]["started_at"] if i + 1 < len(tries) else end
        world = t["world_size"] or run.world_size
        allocation += max(0.0, t_end - t["started_at"]) * world
        spans.append((t, world))
    if not tries:
        allocation = max(0.0, end - start) * run.world_size
    kept, kept_steps = _rank_seconds(conn, run_id, "step_time")
    waited, _ = _rank_seconds(conn, run_id, "data_wait")
    replayed = recovery = 0.0
    replayed_steps = 0
    per_attempt = []
    for i, (t, world) in enumerate(spans):
        lost = down = 0.0
        lost_steps = 0
        nxt = tries[i + 1] if i + 1 < len(tries) else None
        if nxt is not None and t["processes"]:
            resume = nxt["first_step"]
            ends = [p["last_step_end"] for p in t["processes"] if p["last_step_end"] is not None]
            firsts = [
                p["first_step_at"] for p in nxt["processes"] if p["first_step_at"] is not None
            ]
            if ends and firsts:
                down = (
                    max(0.0, min(firsts) - max(ends)) * nxt["world_size"]
                    if nxt["world_size"]
                    else 0.0
                )
            stored = _step_ends(conn, run_id, resume - 1) if resume else {}
            for p in t["processes"]:
                if resume is None or p["last_step"] is None or p["last_step_end"] is None:
                    continue
                if p["last_step"] < resume:
                    continue  # nothing it did is run again
                lost_steps = max(lost_steps, p["last_step"] - resume + 1)
                # The end of the last step it did that was kept, if this process did it.
                mine = stored.get(p["rank"])
                kept_end = mine[1] if mine is not None and mine[0] >= p["started_at"] else None
                begin = kept_end if kept_end is not None else p["first_step_at"]
                if begin is not None:
                    lost += max(0.0, p["last_step_end"] - begin)
        replayed += lost
        recovery += down
        replayed_steps += lost_steps
        per_attempt.append(
            {
                "number": t["number"],
                "world_size": world,
                "replayed_gpu_s": lost,
                "replayed_steps": lost_steps,
                "recovery_gpu_s": down,
            }
        )
    # In-process rollbacks: the steps since the checkpoint are run again.
    mean_step = (kept + waited) / max(1, kept_steps * (run.world_size or 1))
    rollbacks = 0
    ac = m.actions.c
    for plan, result in conn.execute(
        select(ac.plan, ac.result).where(
            ac.run_id == run_id, ac.kind == "rollback", ac.state == "done"
        )
    ):
        plan = plan or {}
        barrier, ckpt = plan.get("barrier_step"), _restored_step(plan, result)
        if isinstance(barrier, int) and isinstance(ckpt, int) and barrier > ckpt:
            rollbacks += 1
            replayed_steps += barrier - ckpt
            replayed += (barrier - ckpt) * mean_step * (run.world_size or 1)
            restore = [
                _number((r or {}).get("seconds"))
                for r in ((result or {}).get("ranks") or {}).values()
            ]
            replayed += sum(x for x in restore if x is not None)
    ckpt_s = 0.0
    for c in checkpoints["_by_step"]:
        if c["seconds"] is not None:
            ckpt_s += c["seconds"] * (run.world_size or 1)  # every rank waits for the slowest
    data_wait = max(0.0, waited - ckpt_s)
    other = max(0.0, allocation - kept - replayed - recovery - ckpt_s - data_wait)
    price = settings.price_per_gpu_hour
    used_h, lost_h = allocation / 3600, max(0.0, allocation - kept) / 3600
    failures = sum(1 for t in tries[:-1] if t["exit_reason"] in FAILED_ENDS) + rollbacks
    if tries and tries[-1]["state"] == "ended" and tries[-1]["exit_reason"] in FAILED_ENDS:
        failures += 1
    return {
        "since": start,
        "until": end,
        "wall_s": end - start,
        "running": not finished,
        "allocation_gpu_s": allocation,
        "ettr": kept / allocation if allocation > 0 else None,
        "breakdown_gpu_s": {
            "kept": kept,
            "replayed": replayed,
            "recovery": recovery,
            "checkpoint": ckpt_s,
            "data_wait": data_wait,
            "other": other,
        },
        "kept_steps": kept_steps,
        "replayed_steps": replayed_steps,
        "attempts": len(tries),
        "interruptions": failures,
        "rollbacks": rollbacks,
        "per_attempt": per_attempt,
        "gpu_hours": {"used": used_h, "kept": kept / 3600, "lost": lost_h},
        "price_per_gpu_hour": price,
        "cost": None if price is None else {"used": used_h * price, "lost": lost_h * price},
    }


# -- the cadence advisor -------------------------------------------------------------------------


def waste(interval_s: float, cost_s: float, mtbf_s: float) -> float:
    """Expected fraction of time wasted checkpointing every ``interval_s`` seconds at a
    blocking cost ``cost_s`` with failures every ``mtbf_s`` on average:
    C/T + (T + C) / (2 tau)."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError("interval and MTBF must be positive")
    return cost_s / interval_s + (interval_s + cost_s) / (2 * mtbf_s)


def optimal_interval(cost_s: float, mtbf_s: float) -> float:
    """T* = sqrt(2 C tau), the interval that minimises :func:`waste`."""
    if cost_s < 0 or mtbf_s <= 0:
        raise ValueError("cost must be >= 0 and MTBF positive")
    return math.sqrt(2 * cost_s * mtbf_s)


def advise(
    *,
    cost_s: float | None,
    interval_s: float | None,
    wall_s: float,
    interruptions: int,
    world_size: int,
    settings: EconomicsSettings,
) -> dict[str, Any]:
    """T*, the waste at the current interval and at T*, and a verdict."""
    if interruptions >= MIN_FAILURES and wall_s > 0:
        tau = wall_s / interruptions
        source = f"observed: {interruptions} interruptions in {wall_s / 3600:.2f} h"
    elif settings.mtbf_hours is not None:
        tau = settings.mtbf_hours * 3600
        source = f"configured: MTBF {settings.mtbf_hours:g} h (--mtbf-hours)"
    else:
        tau = settings.gpu_mtbf_hours * 3600 / max(1, world_size)
        source = (
            f"default: {settings.gpu_mtbf_hours:,.0f} h per GPU / {world_size} GPUs "
            f"(set --mtbf-hours; the run has {interruptions} interruptions, needs {MIN_FAILURES})"
        )
    out: dict[str, Any] = {
        "cost_s": cost_s,
        "interval_s": interval_s,
        "mtbf_s": tau,
        "mtbf_source": source,
        "optimal_interval_s": None,
        "waste_now": None,
        "waste_optimal": None,
        "ratio": None,
        "verdict": "unknown",
    }
    if cost_s is None:
        out["why"] = "no checkpoint reported its blocking save time (tw.checkpointing or seconds=)"
        return out
    best = optimal_interval(cost_s, tau)
    out["optimal_interval_s"] = best
    out["waste_optimal"] = waste(best, cost_s, tau) if best > 0 else None
    if interval_s is None or interval_s <= 0:
        out["why"] = "fewer than two checkpoints: no interval yet"
        return out
    out["waste_now"] = waste(interval_s, cost_s, tau)
    ratio = interval_s / best if best > 0 else math.inf
    out["ratio"] = ratio
    if ratio > OFF_BY:
        out["verdict"] = "too_rare"
    elif ratio < 1 / OFF_BY:
        out["verdict"] = "too_often"
    else:
        out["verdict"] = "ok"
    return out


def economics(
    conn: Connection,
    run: str,
    *,
    settings: EconomicsSettings | None = None,
    now: float | None = None,
) -> dict[str, Any] | None:
    """Checkpoints, goodput and the advisor of one run (None: no such run)."""
    settings = settings or EconomicsSettings()
    row = _run_row(conn, run)
    if row is None:
        return None
    now = time.time() if now is None else now
    tries = attempts(conn, row.id, now=now)
    ckpt = checkpoint_stats(conn, row.id)
    good = goodput(conn, row.id, settings=settings, now=now, tries=tries, checkpoints=ckpt)
    world = (tries[-1]["world_size"] if tries else None) or row.world_size
    advice = advise(
        cost_s=ckpt["blocking_s"],
        interval_s=ckpt["interval_s"],
        wall_s=good["wall_s"],
        interruptions=good["interruptions"],
        world_size=world,
        settings=settings,
    )
    ckpt = {k: v for k, v in ckpt.items() if not k.startswith("_")}
    return {"run": run, "checkpoints": ckpt, "goodput": good, "advisor": advice}
