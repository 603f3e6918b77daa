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

from trainwarden.collector.read.identity import (
    attempts,
    run_row,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import RollbackPlan
from trainwarden.collector.store.errors import NotFound

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


def _restored_step(plan: RollbackPlan, result: dict[str, Any] | None) -> int | None:
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
    return plan.rollback.checkpoint_step if plan.rollback else plan.checkpoint_step


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
    finished = run.status in ("finished", "failed", "stopped") or (
        tries and tries[-1]["state"] == "ended"
    )
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
        stored = RollbackPlan.of(plan)
        barrier, ckpt = stored.barrier_step, _restored_step(stored, result)
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
    row = run_row(conn, run)
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


def settings_of(s: Any) -> EconomicsSettings:
    """The economics part of serve's :class:`~trainwarden.collector.settings.Settings`."""
    return EconomicsSettings(
        price_per_gpu_hour=s.price_per_gpu_hour,
        mtbf_hours=s.mtbf_hours,
        gpu_mtbf_hours=s.gpu_mtbf_hours,
    )


def run_economics(conn: Connection, *, run: str, settings: EconomicsSettings) -> dict[str, Any]:
    """``GET /api/v1/runs/{run}/economics``; NotFound for an unknown run."""
    found = economics(conn, run, settings=settings)
    if found is None:
        raise NotFound(f"run {run!r} not found")
    return found
