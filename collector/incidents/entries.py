"""A timeline's entries, one source at a time: alerts (onset, pending, firing, acked,
cleared, resolved), actions, events, attempts, notes and the incident itself, each a
plain dict with its time, step, where, severity, text and links."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from trainwarden.collector.ingest import crashes
from trainwarden.collector.store import models as m

END_SEVERITY = {
    "exception": "critical",
    "lost": "critical",
    "evicted": "critical",
    "sigterm": "warning",
}
"""How an attempt's end reads: a crash or a lost process, a signal, else (completed,
stopped) info."""


FAULT_KINDS = ("drill", "xid", "loss_divergence", crashes.KIND)


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


def timeline_entry(
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


def entry_order(e: dict[str, Any]) -> tuple[float, int]:
    key = f"{e['source']}:{e['kind']}"
    return e["at"], ORDER.get(key, ORDER.get(e["source"], 6))


class Links:
    def __init__(self, base: str, run: str) -> None:
        self.base, self.run = base.rstrip("/"), run

    def __call__(self, path: str) -> str:
        return f"{self.base}{path}"

    def runbook(self, url: str | None) -> str | None:
        if url and url.startswith("/"):
            return self(url)
        return url


def alert_entries(conn: Connection, alert_rows: list[Any], link: Links) -> list[dict[str, Any]]:
    out = []
    ui = link(f"/alerts?run={link.run}")
    for a in alert_rows:
        rb = link.runbook((a.annotations or {}).get("runbook_url"))
        desc = (
            (a.annotations or {}).get("description") or (a.annotations or {}).get("summary") or ""
        )
        common = dict(rank=a.rank, node=a.node, runbook_url=rb, ui_url=ui, ref={"alert": a.id})
        if a.onset_step is not None and a.onset_step != a.active_since_step:
            began = step_ts(conn, a.run_id, a.onset_step) or a.active_since
            out.append(
                timeline_entry(
                    min(began, a.active_since),
                    "alert",
                    "onset",
                    f"{a.rule}: its condition began at step {a.onset_step} (seen at step "
                    f"{a.active_since_step})",
                    step=a.onset_step,
                    severity=a.severity,
                    **common,
                )
            )
        out.append(
            timeline_entry(
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
                timeline_entry(
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
            out.append(
                timeline_entry(a.acked_at, "alert", "acked", f"{a.rule} acknowledged{by}", **common)
            )
        if a.state == "resolved" and a.cleared_at is not None and a.cleared_at != a.resolved_at:
            out.append(
                timeline_entry(
                    a.cleared_at,
                    "alert",
                    "cleared",
                    f"{a.rule}: condition cleared",
                    step=a.cleared_at_step,
                    **common,
                )
            )
        if a.resolved_at is not None:
            out.append(
                timeline_entry(a.resolved_at, "alert", "resolved", f"{a.rule} resolved", **common)
            )
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
            timeline_entry(
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


def action_entries(action_rows: list[Any], link: Links) -> list[dict[str, Any]]:
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
                timeline_entry(
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
        if data.get("timed_out"):
            return f"drill {what} timed out: the rank exits"
        if isinstance(data.get("scale"), (int, float)):
            what += f" x{data['scale']:g}"
        return f"fault injected (drill): {what}"
    if kind == "xid":
        return f"XID {data.get('code')} on GPU {data.get('gpu_uuid') or '?'}"
    if kind == "rank_state":
        why = f" ({data['reason']})" if data.get("reason") else ""
        return f"rank state {data.get('from')} -> {data.get('to')}{why}"
    if kind == "hang_verdict":
        return f"hung collective: {data.get('summary')}"
    if kind == crashes.KIND:  # its last words, sent by a survivor of its node
        return f"process {crashes.line(data)}"
    if kind == "data_order_drift":
        return f"data left its path: {data.get('reason')}"
    if kind == "duplicate_batch":
        return f"same batch on several ranks: {data.get('reason')}"
    if kind == "replica_divergence":  # the evaluator's reason says what, where and since when
        return f"replicas disagree ({data.get('check') or 'parameters'}): {data.get('reason')}"
    if kind == "checkpoint":
        return f"checkpoint saved: {data.get('path') or '?'}"
    if kind == "restart":
        return "rank restarted (new process session)"
    if kind == "rank_conflict":  # names both processes: pid, node, session
        return str(data.get("reason") or "two live processes claim one rank")
    if kind == "shutdown":
        cause = data.get("error") or data.get("reason")
        return "rank shut down" + (f": {cause}" if cause else "")
    extra = ", ".join(f"{k}={v}" for k, v in data.items() if not isinstance(v, (dict, list)))
    return kind.replace("_", " ") + (f": {extra}" if extra else "")


def _is_fault(kind: str, data: dict[str, Any]) -> bool:
    return kind in FAULT_KINDS or (kind == "rank_state" and data.get("to") in BAD_STATES)


def event_entries(
    rows: list[Any], nodes: dict[int, str | None], link: Links
) -> list[dict[str, Any]]:
    ui = link(f"/runs/{link.run}")
    return [
        timeline_entry(
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


def attempt_entries(
    tries: list[dict[str, Any]], start: float, end: float, link: Links
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
                timeline_entry(
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
                timeline_entry(
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


def note_entries(rows: list[Any]) -> list[dict[str, Any]]:
    return [
        timeline_entry(
            n.at,
            "note",
            "note",
            f"{n.author}: {n.text}",
            step=n.step,
            ref={"note": n.id, "author": n.author},
        )
        for n in rows
    ]


def incident_entries(incident: dict[str, Any], link: Links) -> list[dict[str, Any]]:
    ui = link(f"/runs/{link.run}/timeline?incident={incident['id']}")
    return [
        timeline_entry(
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


def step_ts(conn: Connection, run_id: int, step: int) -> float | None:
    """When ``step`` of the run began (its rolled-up step time's timestamp)."""
    s = m.step_stats.c
    return conn.execute(
        select(s.ts).where(s.run_id == run_id, s.metric == "step_time", s.step == step)
    ).scalar()
