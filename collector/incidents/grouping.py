"""The incident engine's pass: group a run's firing alerts and its actions into one open
incident (escalating its severity and title as worse ones join), and close it once all
has been quiet for the cool-down."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, and_, select

from trainwarden.collector.incidents.store import (
    ENDED,
    ENGINE,
    SEVERITY_ORDER,
    append_log,
    attach,
    create_incident,
    incident_row,
    log_line,
    member_of,
    open_incident_of,
    set_closed,
    widen,
    worse_of,
)
from trainwarden.collector.store import models as m


@dataclass
class PassResult:
    opened: list[int]
    joined: int
    closed: list[int]


def group(conn: Connection, *, now: float, cooldown_s: float) -> PassResult:
    """One pass of grouping: open, gather, close (see the module's docstring)."""
    result = PassResult([], 0, [])
    a, ac, inc = m.alerts.c, m.actions.c, m.incidents.c
    fired = conn.execute(
        select(a.id, a.run_id, a.rule, a.rank, a.node, a.severity, a.fired_at)
        .where(a.fired_at.is_not(None), ~member_of("alert", a.id))
        .order_by(a.fired_at, a.id)
    ).all()
    # A run's new alerts join its incident together: a job that dies whole fires a
    # RankDead alert a rank, and widening the incident by each in turn rewrote its rank
    # list once a rank (16,384 ranks: minutes of one pass, quadratic).
    by_run: dict[int, list[Any]] = {}
    for alert in fired:
        by_run.setdefault(alert.run_id, []).append(alert)
    for run_id, alerts in by_run.items():
        incident_id = open_incident_of(conn, run_id)
        severity = None
        if incident_id is not None:
            severity = conn.execute(select(inc.severity).where(inc.id == incident_id)).scalar_one()
        for alert in alerts:
            where = f" on rank {alert.rank}" if alert.rank is not None else ""
            where += f" ({alert.node})" if alert.node else ""
            title = f"{alert.rule}{where}"
            if incident_id is None:
                incident_id = create_incident(
                    conn,
                    run_id=run_id,
                    title=title,
                    by=ENGINE,
                    auto=True,
                    severity=alert.severity,
                    opened_at=alert.fired_at,
                    now=now,
                    detail=f"alert {alert.id} ({alert.rule}) fired",
                )
                result.opened.append(incident_id)
            elif SEVERITY_ORDER.get(alert.severity, 0) > SEVERITY_ORDER.get(severity or "", 0):
                _escalate(conn, incident_id, title=title, alert=alert, now=now)
            severity = alert.severity if severity is None else worse_of(severity, alert.severity)
        assert incident_id is not None
        attach(conn, incident_id, "alert", [alert.id for alert in alerts], now)
        widen(
            conn,
            incident_id,
            ranks=[alert.rank for alert in alerts],
            nodes=[alert.node for alert in alerts],
            severity=severity,
            now=now,
        )
        result.joined += len(alerts)
    loose = conn.execute(
        select(ac.id, ac.run_id, ac.alert_id, ac.rank, ac.node, ac.created_at).where(
            ~member_of("action", ac.id)
        )
    ).all()
    i = m.incident_items.c
    for action in loose:
        target = None
        if action.alert_id is not None:
            target = conn.execute(
                select(i.incident_id).where(i.kind == "alert", i.item_id == action.alert_id)
            ).scalar()
        if target is None:
            open_ = conn.execute(
                select(inc.id)
                .where(
                    inc.run_id == action.run_id,
                    inc.state == "open",
                    inc.opened_at <= action.created_at,
                )
                .order_by(inc.opened_at.desc())
                .limit(1)
            ).scalar()
            target = open_
        if target is None:
            continue
        attach(conn, target, "action", [action.id], now)
        widen(conn, target, ranks=[action.rank], nodes=[action.node], now=now)
        result.joined += 1
    for row in conn.execute(
        select(inc.id, inc.opened_at).where(inc.state == "open", inc.auto == 1)
    ).all():
        quiet_since = _quiet_since(conn, row.id, row.opened_at)
        if quiet_since is not None and now - quiet_since >= cooldown_s:
            set_closed(
                conn,
                row.id,
                by=ENGINE,
                now=now,
                detail="every alert resolved and every action ended; quiet for "
                f"{now - quiet_since:.0f} s",
            )
            result.closed.append(row.id)
    return result


def _escalate(conn: Connection, incident_id: int, *, title: str, alert: Any, now: float) -> None:
    """A more severe alert joining an incident the engine titled takes over its title
    (a warning's incident that an XID joined read "StepTimeRegression" under a critical
    badge). A title an operator gave is theirs: it stays."""
    row = incident_row(conn, incident_id)
    if not row.auto or SEVERITY_ORDER.get(alert.severity, 0) <= SEVERITY_ORDER.get(row.severity, 0):
        return
    if any(e.get("what") == "retitled" and e.get("by") != ENGINE for e in row.history or []):
        return
    append_log(
        conn,
        row,
        log_line(
            "retitled",
            ENGINE,
            now,
            f"{row.title!r} -> {title!r}: alert {alert.id} ({alert.rule}, {alert.severity}) joined",
        ),
        title=title[:200],
    )


def _quiet_since(conn: Connection, incident_id: int, opened_at: float) -> float | None:
    """When the incident's last alert resolved or last action ended; None while one is
    still open."""
    i, a, ac = m.incident_items.c, m.alerts.c, m.actions.c
    latest = opened_at
    alerts = conn.execute(
        select(a.state, a.resolved_at)
        .join(m.incident_items, and_(i.kind == "alert", i.item_id == a.id))
        .where(i.incident_id == incident_id)
    ).all()
    for state, resolved_at in alerts:
        if state != "resolved":
            return None
        latest = max(latest, resolved_at or latest)
    actions = conn.execute(
        select(ac.state, ac.finished_at)
        .join(m.incident_items, and_(i.kind == "action", i.item_id == ac.id))
        .where(i.incident_id == incident_id)
    ).all()
    for state, finished_at in actions:
        if state not in ENDED:
            return None
        latest = max(latest, finished_at or latest)
    return latest
