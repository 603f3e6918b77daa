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

from sqlalchemy import Connection, exists, insert, select, update

from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.read.queries import run_id_of as _run_id
from trainwarden.collector.store import models as m
from trainwarden.collector.store.errors import Conflict, Invalid

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_696E_6364  # "twincd": one incident engine across collectors
ENGINE = "trainwarden"
ENDED = ("done", "failed", "cancelled")
SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}


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


def worse_of(a: str, b: str) -> str:
    return a if SEVERITY_ORDER.get(a, 0) >= SEVERITY_ORDER.get(b, 0) else b


def log_line(what: str, by: str, now: float, detail: str | None = None) -> dict[str, Any]:
    return {"at": now, "what": what, "by": by, "detail": detail}


def member_of(kind: str, column: Any) -> Any:
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


def open_incident_of(conn: Connection, run_id: int) -> int | None:
    inc = m.incidents.c
    return conn.execute(
        select(inc.id)
        .where(inc.run_id == run_id, inc.state == "open")
        .order_by(inc.opened_at.desc(), inc.id.desc())
        .limit(1)
    ).scalar()


def create_incident(
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
                history=[log_line("opened", by, now, detail)],
            )
            .returning(m.incidents.c.id)
        ).scalar_one()
    )


def attach(conn: Connection, incident_id: int, kind: str, ids: Sequence[int], now: float) -> None:
    if ids:
        conn.execute(
            insert(m.incident_items),
            [
                {"kind": kind, "item_id": i, "incident_id": incident_id, "added_at": now}
                for i in ids
            ],
        )


def widen(
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
        "severity": worse_of(row.severity, severity or row.severity),
    }
    if values != {"ranks": row.ranks, "nodes": row.nodes, "severity": row.severity}:
        conn.execute(
            update(m.incidents).where(inc.id == incident_id).values(updated_at=now, **values)
        )


def incident_row(conn: Connection, incident_id: int) -> Any:
    row = conn.execute(
        select(m.incidents, m.runs.c.name.label("run_name"))
        .join(m.runs, m.runs.c.id == m.incidents.c.run_id)
        .where(m.incidents.c.id == incident_id)
    ).first()
    if row is None:
        raise NotFound(f"incident {incident_id} not found")
    return row


def append_log(conn: Connection, row: Any, entry: dict[str, Any], **values: Any) -> None:
    conn.execute(
        update(m.incidents)
        .where(m.incidents.c.id == row.id)
        .values(history=[*(row.history or []), entry], updated_at=entry["at"], **values)
    )


def set_closed(
    conn: Connection,
    incident_id: int,
    *,
    by: str,
    now: float,
    detail: str | None = None,
    summary: str | None = None,
) -> None:
    row = incident_row(conn, incident_id)
    values: dict[str, Any] = {"state": "closed", "closed_at": now, "closed_by": by}
    if summary:
        values["summary"] = summary[:2000]
    append_log(conn, row, log_line("closed", by, now, detail or summary), **values)


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
    return describe(conn, incident_row(conn, incident_id))


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
        severity = worse_of(severity, r.severity)
    incident_id = create_incident(
        conn,
        run_id=run_id,
        title=title,
        by=by,
        auto=False,
        severity=severity,
        opened_at=opened_at,
        now=now,
    )
    attach(conn, incident_id, "alert", sorted(found), now)
    widen(conn, incident_id, ranks=[r.rank for r in rows], nodes=[r.node for r in rows], now=now)
    return incident_id


def close_incident(
    conn: Connection, *, incident_id: int, by: str, summary: str | None = None, now: float
) -> None:
    row = incident_row(conn, incident_id)
    if row.state != "open":
        raise Conflict(f"incident {incident_id} is {row.state}; only an open one can be closed")
    set_closed(conn, incident_id, by=by, now=now, summary=summary)


def retitle_incident(
    conn: Connection, *, incident_id: int, title: str, by: str, now: float
) -> None:
    row = incident_row(conn, incident_id)
    if row.state == "merged":
        raise Conflict(
            f"incident {incident_id} was merged into {row.merged_into}; retitle that one"
        )
    if row.title != title:
        append_log(
            conn, row, log_line("retitled", by, now, f"{row.title!r} -> {title!r}"), title=title
        )


def merge_incidents(
    conn: Connection, *, into: int, sources: Sequence[int], by: str, now: float
) -> None:
    """Move the alerts, actions and notes of ``sources`` into ``into`` (same run); the
    sources stay on record as ``merged`` and point at it."""
    target = incident_row(conn, into)
    if target.state == "merged":
        raise Conflict(f"incident {into} was merged into {target.merged_into}; merge into that one")
    if not sources or into in sources:
        raise Invalid("merge: name at least one other incident to merge in")
    inc, i, n = m.incidents.c, m.incident_items.c, m.notes.c
    rows = [incident_row(conn, s) for s in dict.fromkeys(sources)]
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
        severity = worse_of(severity, row.severity)
        append_log(
            conn,
            row,
            log_line("merged", by, now, f"into incident {into}"),
            state="merged",
            merged_into=into,
            closed_at=row.closed_at or now,
            closed_by=row.closed_by or by,
        )
    target = incident_row(conn, into)
    append_log(
        conn,
        target,
        log_line("merged", by, now, "merged in incident " + ", ".join(map(str, ids))),
        opened_at=min([target.opened_at, *(r.opened_at for r in rows)]),
        severity=severity,
    )
    widen(
        conn,
        into,
        ranks=[x for r in rows for x in r.ranks or []],
        nodes=[x for r in rows for x in r.nodes or []],
        now=now,
    )
    conn.execute(update(m.incidents).where(inc.id == into).values(updated_at=now))
