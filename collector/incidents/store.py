"""Incidents: what happened to a run around one problem, and the operator logbook.

The engine (one pass every ``interval_s`` inside ``serve``; one collector at a time on
PostgreSQL through an advisory lock, as for alerts and actions):

1. **Open**: an alert of a run that fired and belongs to no incident joins the run's
   open incident, or opens one (titled after it) when the run has none. A more severe
   alert that joins takes over the title, unless an operator gave one.
2. **Gather**: an action joins the incident of the alert that triggered it; an
   operator's action (no alert) joins the run's open incident if it came after it
   opened. The run's events and notes join by time (see ``collector/incidents/timeline.py``);
   the ranks and nodes of every member are kept as the incident's scope.
3. **Close**: an incident the engine opened closes once every alert of it resolved,
   every action of it ended, and nothing changed for ``cooldown_s``. An alert that
   fires during the cool-down joins it and keeps it open. Incidents an operator opened
   are closed by an operator.

Operators open, close, merge and retitle incidents (``collector/api/routes/incidents.py``);
each change is kept in the incident's ``history``. With a ``post_url``, the engine
posts each incident's report when it closes (``incident_engine.py``, ``postmortem.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, and_, exists, insert, select, update

from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.read.queries import run_id_of as _run_id
from trainwarden.collector.store import models as m

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_696E_6364  # "twincd": one incident engine across collectors
ENGINE = "trainwarden"
ENDED = ("done", "failed", "cancelled")
SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}


class Conflict(ValueError):
    """The incident is not in a state that allows this (HTTP 409)."""


class Invalid(ValueError):
    """The request names something that does not fit (HTTP 422)."""


@dataclass(frozen=True)
class IncidentSettings:
    interval_s: float = 2.0
    cooldown_s: float = 300.0
    """An incident closes this long after its last alert resolved and its last action
    ended (``serve --incident-cooldown``, ``TRAINWARDEN_INCIDENT_COOLDOWN_S``)."""
    post_url: str | None = None
    """Post each incident's report here when it closes (``serve --postmortem-post``)."""
    post_kind: str = "auto"
    price_per_gpu_hour: float | None = None


def _worse(a: str, b: str) -> str:
    return a if SEVERITY_ORDER.get(a, 0) >= SEVERITY_ORDER.get(b, 0) else b


def _entry(what: str, by: str, now: float, detail: str | None = None) -> dict[str, Any]:
    return {"at": now, "what": what, "by": by, "detail": detail}


def _member(kind: str, column: Any) -> Any:
    i = m.incident_items.c
    return exists().where(i.kind == kind, i.item_id == column)


def _scope(values: Iterable[Any], add: Iterable[Any]) -> list[Any]:
    """Ranks and nodes joined, in number order: 2 before 10, node2 before node10."""
    return sorted({*values, *(v for v in add if v is not None)}, key=_natural)


def _natural(value: Any) -> tuple[Any, ...]:
    if isinstance(value, int):
        return (0, value)
    # Split into text and numbers: even places are text, odd places numbers.
    parts = re.split(r"(\d+)", str(value))
    return (1, *(int(p) if i % 2 else p for i, p in enumerate(parts)))


# -- the engine's pass --------------------------------------------------------------


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
        .where(a.fired_at.is_not(None), ~_member("alert", a.id))
        .order_by(a.fired_at, a.id)
    ).all()
    # A run's new alerts join its incident together: a job that dies whole fires a
    # RankDead alert a rank, and widening the incident by each in turn rewrote its rank
    # list once a rank (16,384 ranks: minutes of one pass, quadratic).
    by_run: dict[int, list[Any]] = {}
    for alert in fired:
        by_run.setdefault(alert.run_id, []).append(alert)
    for run_id, alerts in by_run.items():
        incident_id = _open_of(conn, run_id)
        severity = None
        if incident_id is not None:
            severity = conn.execute(select(inc.severity).where(inc.id == incident_id)).scalar_one()
        for alert in alerts:
            where = f" on rank {alert.rank}" if alert.rank is not None else ""
            where += f" ({alert.node})" if alert.node else ""
            title = f"{alert.rule}{where}"
            if incident_id is None:
                incident_id = _create(
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
            severity = alert.severity if severity is None else _worse(severity, alert.severity)
        assert incident_id is not None
        _attach(conn, incident_id, "alert", [alert.id for alert in alerts], now)
        _widen(
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
            ~_member("action", ac.id)
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
        _attach(conn, target, "action", [action.id], now)
        _widen(conn, target, ranks=[action.rank], nodes=[action.node], now=now)
        result.joined += 1
    for row in conn.execute(
        select(inc.id, inc.opened_at).where(inc.state == "open", inc.auto == 1)
    ).all():
        quiet_since = _quiet_since(conn, row.id, row.opened_at)
        if quiet_since is not None and now - quiet_since >= cooldown_s:
            _set_closed(
                conn,
                row.id,
                by=ENGINE,
                now=now,
                detail=f"every alert resolved and every action ended; quiet for {now - quiet_since:.0f} s",
            )
            result.closed.append(row.id)
    return result


def _escalate(conn: Connection, incident_id: int, *, title: str, alert: Any, now: float) -> None:
    """A more severe alert joining an incident the engine titled takes over its title
    (a warning's incident that an XID joined read "StepTimeRegression" under a critical
    badge). A title an operator gave is theirs: it stays."""
    row = _get(conn, incident_id)
    if not row.auto or SEVERITY_ORDER.get(alert.severity, 0) <= SEVERITY_ORDER.get(row.severity, 0):
        return
    if any(e.get("what") == "retitled" and e.get("by") != ENGINE for e in row.history or []):
        return
    _log(
        conn,
        row,
        _entry(
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


def _open_of(conn: Connection, run_id: int) -> int | None:
    inc = m.incidents.c
    return conn.execute(
        select(inc.id)
        .where(inc.run_id == run_id, inc.state == "open")
        .order_by(inc.opened_at.desc(), inc.id.desc())
        .limit(1)
    ).scalar()


def _create(
    conn: Connection,
    *,
    run_id: int,
    title: str,
    by: str,
    auto: bool,
    severity: str,
    opened_at: float,
    now: float,
    detail: str | None = None,
) -> int:
    return int(
        conn.execute(
            insert(m.incidents)
            .values(
                run_id=run_id,
                title=title[:200],
                state="open",
                severity=severity,
                auto=int(auto),
                opened_at=opened_at,
                opened_by=by,
                ranks=[],
                nodes=[],
                updated_at=now,
                history=[_entry("opened", by, now, detail)],
            )
            .returning(m.incidents.c.id)
        ).scalar_one()
    )


def _attach(conn: Connection, incident_id: int, kind: str, ids: Sequence[int], now: float) -> None:
    if ids:
        conn.execute(
            insert(m.incident_items),
            [
                {"kind": kind, "item_id": i, "incident_id": incident_id, "added_at": now}
                for i in ids
            ],
        )


def _widen(
    conn: Connection,
    incident_id: int,
    *,
    ranks: Iterable[int | None] = (),
    nodes: Iterable[str | None] = (),
    severity: str | None = None,
    now: float,
) -> None:
    inc = m.incidents.c
    row = conn.execute(
        select(inc.ranks, inc.nodes, inc.severity).where(inc.id == incident_id)
    ).one()
    values = {
        "ranks": _scope(row.ranks or [], ranks),
        "nodes": _scope(row.nodes or [], nodes),
        "severity": _worse(row.severity, severity or row.severity),
    }
    if values != {"ranks": row.ranks, "nodes": row.nodes, "severity": row.severity}:
        conn.execute(
            update(m.incidents).where(inc.id == incident_id).values(updated_at=now, **values)
        )


def _get(conn: Connection, incident_id: int) -> Any:
    row = conn.execute(
        select(m.incidents, m.runs.c.name.label("run_name"))
        .join(m.runs, m.runs.c.id == m.incidents.c.run_id)
        .where(m.incidents.c.id == incident_id)
    ).first()
    if row is None:
        raise NotFound(f"incident {incident_id} not found")
    return row


def _log(conn: Connection, row: Any, entry: dict[str, Any], **values: Any) -> None:
    conn.execute(
        update(m.incidents)
        .where(m.incidents.c.id == row.id)
        .values(history=[*(row.history or []), entry], updated_at=entry["at"], **values)
    )


def _set_closed(
    conn: Connection,
    incident_id: int,
    *,
    by: str,
    now: float,
    detail: str | None = None,
    summary: str | None = None,
) -> None:
    row = _get(conn, incident_id)
    values: dict[str, Any] = {"state": "closed", "closed_at": now, "closed_by": by}
    if summary:
        values["summary"] = summary[:2000]
    _log(conn, row, _entry("closed", by, now, detail or summary), **values)


# -- reading --------------------------------------------------------------------------


def members(conn: Connection, incident_id: int) -> dict[str, list[int]]:
    i = m.incident_items.c
    out: dict[str, list[int]] = {"alert": [], "action": []}
    for kind, item_id in conn.execute(
        select(i.kind, i.item_id).where(i.incident_id == incident_id).order_by(i.item_id)
    ):
        out.setdefault(kind, []).append(item_id)
    return out


def describe(conn: Connection, row: Any) -> dict[str, Any]:
    """An incident as plain data, with the ids of its alerts and actions."""
    items = members(conn, row.id)
    return {
        "id": row.id,
        "run": row.run_name,
        "title": row.title,
        "state": row.state,
        "severity": row.severity,
        "auto": bool(row.auto),
        "opened_at": row.opened_at,
        "opened_by": row.opened_by,
        "closed_at": row.closed_at,
        "closed_by": row.closed_by,
        "summary": row.summary,
        "merged_into": row.merged_into,
        "ranks": list(row.ranks or []),
        "nodes": list(row.nodes or []),
        "history": list(row.history or []),
        "alerts": items["alert"],
        "actions": items["action"],
        "posted_at": row.posted_at,
        "post_status": row.post_status,
        "updated_at": row.updated_at,
    }


def get_incident(conn: Connection, *, incident_id: int) -> dict[str, Any]:
    return describe(conn, _get(conn, incident_id))


def list_incidents(conn: Connection, *, run: str, merged: bool = False) -> list[dict[str, Any]]:
    """A run's incidents, oldest first (``merged``: also those merged into another)."""
    inc = m.incidents.c
    query = (
        select(m.incidents, m.runs.c.name.label("run_name"))
        .join(m.runs, m.runs.c.id == inc.run_id)
        .where(inc.run_id == _run_id(conn, run))
    )
    if not merged:
        query = query.where(inc.state != "merged")
    return [describe(conn, r) for r in conn.execute(query.order_by(inc.opened_at, inc.id))]


# -- operators' changes -------------------------------------------------------------------


def open_incident(
    conn: Connection,
    *,
    run: str,
    title: str,
    by: str,
    alert_ids: Sequence[int] = (),
    at: float | None = None,
    now: float,
) -> int:
    """An operator opens an incident (something is wrong that no alert caught, or these
    alerts belong together). Listed alerts must be of the run and in no incident yet."""
    run_id = _run_id(conn, run)
    a, i = m.alerts.c, m.incident_items.c
    found = {
        r.id: r
        for r in conn.execute(
            select(a.id, a.run_id, a.rank, a.node, a.severity, a.active_since).where(
                a.id.in_(list(alert_ids))
            )
        )
    }
    for alert_id in alert_ids:
        if alert_id not in found or found[alert_id].run_id != run_id:
            raise Invalid(f"alerts: run {run!r} has no alert {alert_id}")
        other = conn.execute(
            select(i.incident_id).where(i.kind == "alert", i.item_id == alert_id)
        ).scalar()
        if other is not None:
            raise Conflict(f"alert {alert_id} is in incident {other}; merge that incident instead")
    rows = list(found.values())
    opened_at = at if at is not None else min((r.active_since for r in rows), default=now)
    severity = "warning"
    for r in rows:
        severity = _worse(severity, r.severity)
    incident_id = _create(
        conn,
        run_id=run_id,
        title=title,
        by=by,
        auto=False,
        severity=severity,
        opened_at=opened_at,
        now=now,
    )
    _attach(conn, incident_id, "alert", sorted(found), now)
    _widen(conn, incident_id, ranks=[r.rank for r in rows], nodes=[r.node for r in rows], now=now)
    return incident_id


def close_incident(
    conn: Connection, *, incident_id: int, by: str, summary: str | None = None, now: float
) -> None:
    row = _get(conn, incident_id)
    if row.state != "open":
        raise Conflict(f"incident {incident_id} is {row.state}; only an open one can be closed")
    _set_closed(conn, incident_id, by=by, now=now, summary=summary)


def retitle_incident(
    conn: Connection, *, incident_id: int, title: str, by: str, now: float
) -> None:
    row = _get(conn, incident_id)
    if row.state == "merged":
        raise Conflict(
            f"incident {incident_id} was merged into {row.merged_into}; retitle that one"
        )
    if row.title != title:
        _log(conn, row, _entry("retitled", by, now, f"{row.title!r} -> {title!r}"), title=title)


def merge_incidents(
    conn: Connection, *, into: int, sources: Sequence[int], by: str, now: float
) -> None:
    """Move the alerts, actions and notes of ``sources`` into ``into`` (same run); the
    sources stay on record as ``merged`` and point at it."""
    target = _get(conn, into)
    if target.state == "merged":
        raise Conflict(f"incident {into} was merged into {target.merged_into}; merge into that one")
    if not sources or into in sources:
        raise Invalid("merge: name at least one other incident to merge in")
    inc, i, n = m.incidents.c, m.incident_items.c, m.notes.c
    rows = [_get(conn, s) for s in dict.fromkeys(sources)]
    for row in rows:
        if row.run_id != target.run_id:
            raise Invalid(f"incident {row.id} is of run {row.run_name!r}, not {target.run_name!r}")
        if row.state == "merged":
            raise Conflict(f"incident {row.id} was already merged into {row.merged_into}")
    ids = [r.id for r in rows]
    conn.execute(update(m.incident_items).where(i.incident_id.in_(ids)).values(incident_id=into))
    conn.execute(update(m.notes).where(n.incident_id.in_(ids)).values(incident_id=into))
    severity = target.severity
    for row in rows:
        severity = _worse(severity, row.severity)
        _log(
            conn,
            row,
            _entry("merged", by, now, f"into incident {into}"),
            state="merged",
            merged_into=into,
            closed_at=row.closed_at or now,
            closed_by=row.closed_by or by,
        )
    target = _get(conn, into)
    _log(
        conn,
        target,
        _entry("merged", by, now, "merged in incident " + ", ".join(map(str, ids))),
        opened_at=min([target.opened_at, *(r.opened_at for r in rows)]),
        severity=severity,
    )
    _widen(
        conn,
        into,
        ranks=[x for r in rows for x in r.ranks or []],
        nodes=[x for r in rows for x in r.nodes or []],
        now=now,
    )
    conn.execute(update(m.incidents).where(inc.id == into).values(updated_at=now))


# -- the logbook ----------------------------------------------------------------------------


def add_note(
    conn: Connection,
    *,
    run: str,
    author: str,
    text: str,
    at: float | None = None,
    step: int | None = None,
    incident_id: int | None = None,
    now: float,
) -> dict[str, Any]:
    """An operator's note on a run, kept with it and shown in its timelines. Without an
    incident it joins the run's open incident, if there is one."""
    run_id = _run_id(conn, run)
    if incident_id is not None:
        row = _get(conn, incident_id)
        if row.run_id != run_id:
            raise Invalid(f"incident {incident_id} is of run {row.run_name!r}, not {run!r}")
        if row.state == "merged":
            incident_id = row.merged_into
    else:
        incident_id = _open_of(conn, run_id)
    note_id = conn.execute(
        insert(m.notes)
        .values(
            run_id=run_id,
            incident_id=incident_id,
            author=author,
            text=text,
            at=at if at is not None else now,
            step=step,
            created_at=now,
        )
        .returning(m.notes.c.id)
    ).scalar_one()
    return _note(conn.execute(select(m.notes).where(m.notes.c.id == note_id)).one(), run)


def _note(row: Any, run: str) -> dict[str, Any]:
    return {
        "id": row.id,
        "run": run,
        "incident": row.incident_id,
        "author": row.author,
        "text": row.text,
        "at": row.at,
        "step": row.step,
        "created_at": row.created_at,
    }


def list_notes(conn: Connection, *, run: str) -> list[dict[str, Any]]:
    n = m.notes.c
    rows = conn.execute(select(m.notes).where(n.run_id == _run_id(conn, run)).order_by(n.at, n.id))
    return [_note(r, run) for r in rows]


# -- inside serve -------------------------------------------------------------------------
