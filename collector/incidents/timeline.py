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

from trainwarden.collector.incidents.entries import (
    Links,
    action_entries,
    alert_entries,
    attempt_entries,
    entry_order,
    event_entries,
    incident_entries,
    note_entries,
)
from trainwarden.collector.incidents.measures import incident_figures
from trainwarden.collector.incidents.store import describe, members
from trainwarden.collector.read.identity import attempts
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.store import models as m

LEAD_S = 120.0
"""How far before an incident's first pending alert its timeline starts."""
NOISE = (
    "action",
    "action_failed",
    "command_ack",
    "gpu_telemetry",
    "attempt_start",
    "attempt_end",
    "collectives",
)
"""Event kinds the timeline leaves out: actions come from their own history, attempts
from theirs (one entry per attempt rather than one per rank); a rank's Flight Recorder
ring (``collectives``) is the raw data of the ``hang_verdict`` entry."""
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
    link = Links(base_url, run)
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
        *alert_entries(conn, list(alert_rows), link),
        *action_entries(list(action_rows), link),
        *event_entries(list(event_rows), nodes, link),
        *note_entries(list(note_rows)),
        *attempt_entries(attempts(conn, ru.id, now=now), start, end, link),
    ]
    figures = None
    if incident is not None:
        entries += incident_entries(incident, link)
        figures = incident_figures(
            conn, ru, list(alert_rows), list(action_rows), entries, start, price_per_gpu_hour
        )
    entries.sort(key=entry_order)
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
