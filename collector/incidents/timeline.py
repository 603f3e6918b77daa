"""A run's timeline, or one incident's, as plain data: ordered entries and the derived
figures of a post-mortem.

Entries (each: ``at``, ``step``, ``source``, ``kind``, ``rank``, ``node``, ``severity``,
``text``, ``runbook_url``, ``ui_url``, ``ref``) come from

- alerts: ``pending`` (active_since), ``firing`` (fired_at), ``acked``, ``cleared`` (the
  condition cleared) and ``resolved``; an incident's own alerts only;
- pages: every delivery attempt of those alerts to a receiver (``source: page``);
- actions: each state of their history (proposed, approved, executing, done, failed,
  cancelled), with the rollback's result;
- the run's events in the window: injected faults (``drill``), XIDs, rank states,
  checkpoints, restarts, shutdowns, loss divergence and your own (``tw.event``);
- attempts (process lifetimes of the run): when each started, and when it ended and why
  (``source: attempt``); the per-rank ``attempt_start`` / ``attempt_end`` events they are
  made of are left out;
- notes of the operator logbook, and the incident's own history (opened, retitled,
  merged, closed);
- ``derived`` entries: the first anomalous step and the recovery.

An incident's window starts ``lead_s`` before its first alert went pending (the fault
comes before its alert) and ends when it closed (or now).

Derived figures (seconds; ``None`` when a moment is missing, e.g. nobody was paged):

- **fault**: the earliest injected fault, XID, loss divergence or bad rank state in the
  window before the first alert went pending, on the alerts' ranks or nodes (any rank
  for an alert about the whole run), else the first flagged or anomalous step;
- **time to detect** = fault -> first alert pending;
- **time to page** = first alert firing -> first page delivered (a receiver answered OK);
- **time to act** = first alert firing -> first action executing (or done), dry runs
  excluded;
- **time to recover** = fault -> recovery: the first step completed after the last
  action finished (when an action was taken), else the moment every alert's condition
  cleared;
- **steps lost** = steps replayed after rollbacks (barrier step - checkpoint step);
- **time lost** = fault -> recovery, plus the replayed steps that had run before the
  fault (at the run's median step time);
- **GPU-hours lost** = world size x time lost; **cost** = GPU-hours x the price per
  GPU-hour (``--price-per-gpu-hour``, ``TRAINWARDEN_PRICE_PER_GPU_HOUR``).
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Connection, and_, or_, select

from trainwarden.collector.incidents.store import describe, members
from trainwarden.collector.read.economics import attempts
from trainwarden.collector.read.queries import NotFound, median_step_time
from trainwarden.collector.store import models as m

LEAD_S = 120.0
"""How far before an incident's first pending alert its timeline starts."""
NOISE = ("action", "action_failed", "command_ack", "gpu_telemetry", "attempt_start", "attempt_end")
"""Event kinds the timeline leaves out: actions come from their own history, attempts
from theirs (one entry per attempt rather than one per rank)."""
END_SEVERITY = {
    "exception": "critical",
    "lost": "critical",
    "evicted": "critical",
    "sigterm": "warning",
}
"""How an attempt's end reads: a crash or a lost process, a signal, else (completed, stopped) info."""
FAULT_KINDS = ("drill", "xid", "loss_divergence")
BAD_STATES = ("slow", "hung", "dead", "failed")
# Ties (same instant) read in causal order: the fault, then its alert, its page, the action.
ORDER = {
    "derived:anomaly": 0,
    "event": 1,
    "attempt": 1,
    "alert:onset": 2,
    "alert:pending": 2,
    "alert:firing": 3,
    "incident": 4,
    "page": 5,
    "action": 6,
    "alert:acked": 7,
    "derived:recovered": 8,
    "alert:cleared": 9,
    "alert:resolved": 10,
    "note": 11,
}
DEFINITIONS = {
    "fault": "the earliest injected fault, XID, loss divergence or bad rank state before the "
    "first alert went pending, on the alerts' ranks or nodes; else the first flagged step",
    "detect_s": "fault -> first alert pending",
    "page_s": "first alert firing -> first page delivered",
    "act_s": "first alert firing -> first action executing (dry runs excluded)",
    "recover_s": "fault -> first step completed after the last action, else every alert's "
    "condition cleared",
    "steps_lost": "steps replayed after rollbacks (barrier step - checkpoint step)",
    "time_lost_s": "fault -> recovery, plus replayed steps that ran before the fault",
    "gpu_hours_lost": "world size x time lost",
    "cost": "GPU-hours lost x price per GPU-hour",
}


def _entry(
    at: float,
    source: str,
    kind: str,
    text: str,
    *,
    step: int | None = None,
    rank: int | None = None,
    node: str | None = None,
    severity: str = "info",
    runbook_url: str | None = None,
    ui_url: str | None = None,
    ref: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "at": at,
        "step": step,
        "source": source,
        "kind": kind,
        "rank": rank,
        "node": node,
        "severity": severity,
        "text": text,
        "runbook_url": runbook_url,
        "ui_url": ui_url,
        "ref": ref or {},
    }


def _order(e: dict[str, Any]) -> tuple[float, int]:
    key = f"{e['source']}:{e['kind']}"
    return e["at"], ORDER.get(key, ORDER.get(e["source"], 6))


class _Links:
    def __init__(self, base: str, run: str) -> None:
        self.base, self.run = base.rstrip("/"), run

    def __call__(self, path: str) -> str:
        return f"{self.base}{path}"

    def runbook(self, url: str | None) -> str | None:
        if url and url.startswith("/"):
            return self(url)
        return url


# -- sources ----------------------------------------------------------------------------


def _alert_entries(conn: Connection, alert_rows: list[Any], link: _Links) -> list[dict[str, Any]]:
    out = []
    ui = link(f"/alerts?run={link.run}")
    for a in alert_rows:
        rb = link.runbook((a.annotations or {}).get("runbook_url"))
        desc = (
            (a.annotations or {}).get("description") or (a.annotations or {}).get("summary") or ""
        )
        common = dict(rank=a.rank, node=a.node, runbook_url=rb, ui_url=ui, ref={"alert": a.id})
        if a.onset_step is not None and a.onset_step != a.active_since_step:
            began = _step_ts(conn, a.run_id, a.onset_step) or a.active_since
            out.append(
                _entry(
                    min(began, a.active_since),
                    "alert",
                    "onset",
                    f"{a.rule}: its condition began at step {a.onset_step} (seen at step {a.active_since_step})",
                    step=a.onset_step,
                    severity=a.severity,
                    **common,
                )
            )
        out.append(
            _entry(
                a.active_since,
                "alert",
                "pending",
                f"{a.rule} pending: {desc}".strip(),
                step=a.active_since_step,
                severity=a.severity,
                **common,
            )
        )
        if a.fired_at is not None:
            out.append(
                _entry(
                    a.fired_at,
                    "alert",
                    "firing",
                    f"{a.rule} firing",
                    step=a.fired_at_step,
                    severity=a.severity,
                    **common,
                )
            )
        if a.acked_at is not None:
            by = f" by {a.acked_by}" + (f": {a.ack_comment}" if a.ack_comment else "")
            out.append(_entry(a.acked_at, "alert", "acked", f"{a.rule} acknowledged{by}", **common))
        if a.state == "resolved" and a.cleared_at is not None and a.cleared_at != a.resolved_at:
            out.append(
                _entry(
                    a.cleared_at,
                    "alert",
                    "cleared",
                    f"{a.rule}: condition cleared",
                    step=a.cleared_at_step,
                    **common,
                )
            )
        if a.resolved_at is not None:
            out.append(_entry(a.resolved_at, "alert", "resolved", f"{a.rule} resolved", **common))
    d = m.alert_deliveries.c
    by_id = {a.id: a for a in alert_rows}
    for r in conn.execute(
        select(m.alert_deliveries).where(d.alert_id.in_(list(by_id))).order_by(d.at, d.id)
    ):
        a = by_id[r.alert_id]
        outcome = f"HTTP {r.http_status}" if r.http_status else (r.error or "no answer")
        verb = "delivered to" if r.ok else "failed at"
        text = f"{a.rule} {r.status} {verb} {r.receiver} ({r.kind}, attempt {r.attempt}): {outcome}"
        out.append(
            _entry(
                r.at + r.duration_s,
                "page",
                "delivered" if r.ok else "failed",
                text,
                rank=a.rank,
                node=a.node,
                severity="info" if r.ok else "warning",
                ref={"alert": a.id, "status": r.status},
            )
        )
    return out


def _action_entries(action_rows: list[Any], link: _Links) -> list[dict[str, Any]]:
    out = []
    for ac in action_rows:
        ui = link(f"/api/v1/actions/{ac.id}")
        dry = " (dry run)" if ac.mode == "dry-run" else ""
        target = (
            f" of node {ac.node}"
            if ac.node
            else (f" of rank {ac.rank}" if ac.rank is not None else "")
        )
        for h in ac.history or []:
            text = f"{ac.kind}{target} {h['state']}{dry}"
            if h.get("by"):
                text += f" by {h['by']}"
            if h.get("detail"):
                text += f": {h['detail']}"
            if h["state"] == "done" and ac.kind == "rollback" and (ac.result or {}).get("ranks"):
                ranks = ac.result["ranks"].values()
                ckpt = {r.get("checkpoint_step") for r in ranks}
                barrier = {r.get("barrier_step") for r in ranks}
                text += (
                    f": every rank ({len(ac.result['ranks'])}) restored checkpoint "
                    f"step {_one(ckpt)} after step {_one(barrier)}"
                )
            severity = {"failed": "critical", "done": "info"}.get(h["state"], "warning")
            out.append(
                _entry(
                    h["at"],
                    "action",
                    h["state"],
                    text,
                    rank=ac.rank,
                    node=ac.node,
                    severity=severity,
                    ui_url=ui,
                    ref={"action": ac.id},
                )
            )
    return out


def _one(values: set[Any]) -> str:
    return str(next(iter(values))) if len(values) == 1 else "/".join(sorted(map(str, values)))


def _event_text(kind: str, data: dict[str, Any]) -> str:
    if kind == "drill":
        what = data.get("spec") or str(data.get("fault"))
        if isinstance(data.get("scale"), (int, float)):
            what += f" x{data['scale']:g}"
        return f"fault injected (drill): {what}"
    if kind == "xid":
        return f"XID {data.get('code')} on GPU {data.get('gpu_uuid') or '?'}"
    if kind == "rank_state":
        why = f" ({data['reason']})" if data.get("reason") else ""
        return f"rank state {data.get('from')} -> {data.get('to')}{why}"
    if kind == "checkpoint":
        return f"checkpoint saved: {data.get('path') or '?'}"
    if kind == "restart":
        return "rank restarted (new process session)"
    if kind == "shutdown":
        cause = data.get("error") or data.get("reason")
        return "rank shut down" + (f": {cause}" if cause else "")
    extra = ", ".join(f"{k}={v}" for k, v in data.items() if not isinstance(v, (dict, list)))
    return kind.replace("_", " ") + (f": {extra}" if extra else "")


def _is_fault(kind: str, data: dict[str, Any]) -> bool:
    return kind in FAULT_KINDS or (kind == "rank_state" and data.get("to") in BAD_STATES)


def _event_entries(
    rows: list[Any], nodes: dict[int, str | None], link: _Links
) -> list[dict[str, Any]]:
    ui = link(f"/runs/{link.run}")
    return [
        _entry(
            e.ts,
            "event",
            e.kind,
            _event_text(e.kind, dict(e.data or {})),
            step=e.step,
            rank=e.rank,
            node=nodes.get(e.rank) if e.rank is not None else None,
            severity=e.severity,
            ui_url=ui,
            ref={"event": e.id, "fault": _is_fault(e.kind, dict(e.data or {}))},
        )
        for e in rows
    ]


def _attempt_entries(
    tries: list[dict[str, Any]], start: float, end: float, link: _Links
) -> list[dict[str, Any]]:
    """An attempt's start and, once it ended, its end and why, inside ``start``..``end``."""
    ui = link(f"/runs/{link.run}/info")
    out = []
    for t in tries:
        n, nodes = t["number"], ", ".join(t["nodes"]) or "?"
        if start <= t["started_at"] <= end:
            text = f"attempt {n} started: world size {t['world_size'] or '?'} on {nodes}"
            if n > 1 and t["first_step"] is not None:
                text += f"; resumed at step {t['first_step']}"
            out.append(
                _entry(
                    t["started_at"],
                    "attempt",
                    "started",
                    text,
                    step=t["first_step"],
                    ui_url=ui,
                    ref={"attempt": n},
                )
            )
        reason, at = t["exit_reason"], t["ended_at"]
        if reason is not None and at is not None and start <= at <= end:
            severity = END_SEVERITY.get(reason, "info")
            text = f"attempt {n} ended ({reason})" + (
                f": {t['exit_detail']}" if t["exit_detail"] else ""
            )
            out.append(
                _entry(
                    at,
                    "attempt",
                    "ended",
                    text,
                    step=t["last_step"],
                    severity=severity,
                    ui_url=ui,
                    ref={"attempt": n, "reason": reason},
                )
            )
    return out


def _note_entries(rows: list[Any]) -> list[dict[str, Any]]:
    return [
        _entry(
            n.at,
            "note",
            "note",
            f"{n.author}: {n.text}",
            step=n.step,
            ref={"note": n.id, "author": n.author},
        )
        for n in rows
    ]


def _incident_entries(incident: dict[str, Any], link: _Links) -> list[dict[str, Any]]:
    ui = link(f"/runs/{link.run}/timeline?incident={incident['id']}")
    return [
        _entry(
            h["at"] if h["what"] != "opened" else incident["opened_at"],
            "incident",
            h["what"],
            f"incident {incident['id']} {h['what']} by {h['by']}"
            + (f": {h['detail']}" if h.get("detail") else ""),
            ui_url=ui,
            ref={"incident": incident["id"]},
        )
        for h in incident["history"]
    ]


# -- the timeline ---------------------------------------------------------------------------


def timeline(
    conn: Connection,
    *,
    run: str,
    incident_id: int | None = None,
    now: float,
    lead_s: float = LEAD_S,
    price_per_gpu_hour: float | None = None,
    base_url: str = "",
    event_limit: int = 5000,
) -> dict[str, Any]:
    """The timeline of one incident of ``run`` (with its derived figures), or of the whole
    run (``incident_id=None``: every alert, action, event and note; no figures)."""
    ru = conn.execute(select(m.runs).where(m.runs.c.name == run)).first()
    if ru is None:
        raise NotFound(f"run {run!r} not found")
    link = _Links(base_url, run)
    a, ac, e, n = m.alerts.c, m.actions.c, m.events.c, m.notes.c
    nodes = {
        r.rank: r.node
        for r in conn.execute(
            select(m.ranks.c.rank, m.ranks.c.node).where(m.ranks.c.run_id == ru.id)
        )
    }
    incident = None
    if incident_id is not None:
        row = conn.execute(
            select(m.incidents, m.runs.c.name.label("run_name"))
            .join(m.runs, m.runs.c.id == m.incidents.c.run_id)
            .where(m.incidents.c.id == incident_id, m.incidents.c.run_id == ru.id)
        ).first()
        if row is None:
            raise NotFound(f"run {run!r} has no incident {incident_id}")
        incident = describe(conn, row)
        items = members(conn, incident_id)
        alert_rows = conn.execute(
            select(m.alerts).where(a.id.in_(items["alert"])).order_by(a.active_since)
        ).all()
        action_rows = conn.execute(
            select(m.actions).where(ac.id.in_(items["action"])).order_by(ac.id)
        ).all()
        first = min([incident["opened_at"], *(r.active_since for r in alert_rows)])
        start = first - lead_s
        end = incident["closed_at"] or now
        end = max(
            [
                end,
                *(r.resolved_at or 0 for r in alert_rows),
                *(r.finished_at or 0 for r in action_rows),
            ]
        )
        note_rows = conn.execute(
            select(m.notes).where(
                n.run_id == ru.id,
                or_(
                    n.incident_id == incident_id,
                    and_(n.incident_id.is_(None), n.at >= start, n.at <= end),
                ),
            )
        ).all()
    else:
        alert_rows = conn.execute(
            select(m.alerts).where(a.run_id == ru.id).order_by(a.active_since)
        ).all()
        action_rows = conn.execute(
            select(m.actions).where(ac.run_id == ru.id).order_by(ac.id)
        ).all()
        # A run's records can predate its row (an agent's clock, a replayed spool).
        start, end = -math.inf, now
        note_rows = conn.execute(select(m.notes).where(n.run_id == ru.id)).all()
    event_rows = conn.execute(
        select(m.events)
        .where(e.run_id == ru.id, e.ts >= max(start, 0.0), e.ts <= end, e.kind.not_in(NOISE))
        .order_by(e.ts, e.id)
        .limit(event_limit)
    ).all()
    entries = [
        *_alert_entries(conn, list(alert_rows), link),
        *_action_entries(list(action_rows), link),
        *_event_entries(list(event_rows), nodes, link),
        *_note_entries(list(note_rows)),
        *_attempt_entries(attempts(conn, ru.id, now=now), start, end, link),
    ]
    figures = None
    if incident is not None:
        entries += _incident_entries(incident, link)
        figures = _figures(
            conn, ru, list(alert_rows), list(action_rows), entries, start, price_per_gpu_hour
        )
    entries.sort(key=_order)
    if incident is None:
        start = min([ru.created_at, *(x["at"] for x in entries[:1])])
    return {
        "run": run,
        "world_size": ru.world_size,
        "incident": incident,
        "window": {"start": start, "end": end},
        "entries": entries,
        "figures": figures,
        "definitions": DEFINITIONS,
    }


# -- derived figures ---------------------------------------------------------------------------


def _figures(
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
        return _entry(
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
    ts = _step_ts(conn, run_id, min(steps))
    if ts is None or ts < start or ts > until:
        return None
    return _entry(
        ts,
        "derived",
        "anomaly",
        f"first anomalous step {min(steps)}",
        step=min(steps),
        severity="warning",
    )


def _step_ts(conn: Connection, run_id: int, step: int) -> float | None:
    """When ``step`` of the run began (its rolled-up step time's timestamp)."""
    s = m.step_stats.c
    return conn.execute(
        select(s.ts).where(s.run_id == run_id, s.metric == "step_time", s.step == step)
    ).scalar()


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
            return _entry(
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
        return _entry(
            at, "derived", "recovered", "recovered: every alert's condition cleared", step=step
        )
    return None
