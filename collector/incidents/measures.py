"""An incident's derived figures from its stored times: the fault, detection, page,
action and recovery moments, their durations, the steps and GPU-hours lost and their
cost (``DEFINITIONS`` in ``timeline.py`` says what each means)."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Connection, select

from trainwarden.collector.incidents.entries import step_ts, timeline_entry
from trainwarden.collector.read.queries import median_step_time
from trainwarden.collector.store import models as m


def incident_figures(
    conn: Connection,
    ru: Any,
    alert_rows: list[Any],
    action_rows: list[Any],
    entries: list[dict[str, Any]],
    start: float,
    price: float | None,
) -> dict[str, Any]:
    """The incident's durations and losses; appends the derived entries it finds."""
    pending_at = min((r.active_since for r in alert_rows), default=None)
    firing_at = min((r.fired_at for r in alert_rows if r.fired_at is not None), default=None)
    paged_at = min(
        (
            x["at"]
            for x in entries
            if x["source"] == "page"
            and x["kind"] == "delivered"
            and x["ref"].get("status") == "firing"
        ),
        default=None,
    )
    real = [r for r in action_rows if r.mode != "dry-run"]
    acted_at = min(
        (h["at"] for r in real for h in r.history or [] if h["state"] in ("executing", "done")),
        default=None,
    )

    # The fault: the earliest fault event before the first alert went pending, else the
    # first flagged (or the alert's own anomalous) step.
    # Only faults where the alerts are: an incident about rank 1 does not start at a
    # thermal drill on rank 0 (alerts about the whole run take any rank's).
    until = pending_at if pending_at is not None else math.inf
    ranks = {r.rank for r in alert_rows}
    nodes = {r.node for r in alert_rows if r.node}

    def near(x: dict[str, Any]) -> bool:
        return None in ranks or x["rank"] is None or x["rank"] in ranks or x["node"] in nodes

    fault = min(
        (
            x
            for x in entries
            if x["source"] == "event" and x["ref"].get("fault") and x["at"] <= until and near(x)
        ),
        key=lambda x: x["at"],
        default=None,
    )
    if fault is None and pending_at is not None:
        fault = _first_anomalous_step(conn, ru.id, alert_rows, start, pending_at)
        if fault is not None:
            entries.append(fault)
    fault_at = fault["at"] if fault else None
    fault_step = fault["step"] if fault else None

    recovered = _recovery(conn, ru.id, alert_rows, real)
    if recovered is not None:
        entries.append(recovered)
    recovered_at = recovered["at"] if recovered else None
    origin = fault_at if fault_at is not None else pending_at

    steps_lost, replayed_before = 0, 0
    for r in real:
        if r.kind != "rollback" or r.state != "done":
            continue
        restored = list(((r.result or {}).get("ranks") or {}).values())
        spans = [
            (x["barrier_step"], x["checkpoint_step"])
            for x in restored
            if x.get("barrier_step") is not None and x.get("checkpoint_step") is not None
        ]
        if spans:
            barrier, ckpt = max(spans)
            steps_lost += barrier - ckpt
            before = (fault_step - ckpt) if fault_step is not None else barrier - ckpt
            replayed_before += max(0, min(before, barrier - ckpt))
    median_step_s = median_step_time(conn, ru.id)
    time_lost = None
    if recovered_at is not None and origin is not None:
        time_lost = max(0.0, recovered_at - origin) + replayed_before * (median_step_s or 0.0)
    gpu_hours = time_lost * ru.world_size / 3600 if time_lost is not None else None
    return {
        "fault_at": fault_at,
        "fault_step": fault_step,
        "fault": fault["text"] if fault else None,
        "pending_at": pending_at,
        "firing_at": firing_at,
        "paged_at": paged_at,
        "acted_at": acted_at,
        "recovered_at": recovered_at,
        "detect_s": _between(fault_at, pending_at),
        "page_s": _between(firing_at, paged_at),
        "act_s": _between(firing_at, acted_at),
        "recover_s": _between(origin, recovered_at),
        "steps_lost": steps_lost,
        "median_step_s": median_step_s,
        "time_lost_s": time_lost,
        "world_size": ru.world_size,
        "gpu_hours_lost": gpu_hours,
        "price_per_gpu_hour": price,
        "cost": gpu_hours * price if gpu_hours is not None and price is not None else None,
    }


def _between(a: float | None, b: float | None) -> float | None:
    return b - a if a is not None and b is not None else None


def _first_anomalous_step(
    conn: Connection, run_id: int, alert_rows: list[Any], start: float, until: float
) -> dict[str, Any] | None:
    r_ = m.rank_steps.c
    flagged = conn.execute(
        select(r_.step, r_.rank, r_.ts, r_.flags)
        .where(r_.run_id == run_id, r_.flags.is_not(None), r_.ts >= start, r_.ts <= until)
        .order_by(r_.ts)
        .limit(1)
    ).first()
    if flagged is not None:
        flags = (
            ", ".join(sorted(flagged.flags))
            if isinstance(flagged.flags, (list, dict))
            else str(flagged.flags)
        )
        return timeline_entry(
            flagged.ts,
            "derived",
            "anomaly",
            f"first flagged step ({flags})",
            step=flagged.step,
            rank=flagged.rank,
            severity="warning",
        )
    steps = [r.onset_step if r.onset_step is not None else r.active_since_step for r in alert_rows]
    steps = [s for s in steps if s is not None]
    if not steps:
        return None
    ts = step_ts(conn, run_id, min(steps))
    if ts is None or ts < start or ts > until:
        return None
    return timeline_entry(
        ts,
        "derived",
        "anomaly",
        f"first anomalous step {min(steps)}",
        step=min(steps),
        severity="warning",
    )


def _recovery(
    conn: Connection, run_id: int, alert_rows: list[Any], real: list[Any]
) -> dict[str, Any] | None:
    done = [r for r in real if r.state == "done" and r.finished_at is not None]
    if done:
        after = max(r.finished_at for r in done)
        s = m.step_stats.c
        first = conn.execute(
            select(s.step, s.ts)
            .where(s.run_id == run_id, s.metric == "step_time", s.ts > after)
            .order_by(s.ts, s.step)
            .limit(1)
        ).first()
        if first is not None:
            kinds = " and ".join(sorted({r.kind for r in done}))
            return timeline_entry(
                first.ts,
                "derived",
                "recovered",
                f"recovered: step {first.step} completed after the {kinds}",
                step=first.step,
            )
    if alert_rows and all(r.state == "resolved" for r in alert_rows):
        at = max((r.cleared_at or r.resolved_at) for r in alert_rows)
        step = max(
            (r.cleared_at_step for r in alert_rows if r.cleared_at_step is not None), default=None
        )
        return timeline_entry(
            at, "derived", "recovered", "recovered: every alert's condition cleared", step=step
        )
    return None
