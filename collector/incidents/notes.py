"""The operator logbook: notes on a run, or on one of its incidents, in its timeline."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, insert, select

from trainwarden.collector.incidents.store import Invalid, incident_row, open_incident_of
from trainwarden.collector.read.queries import run_id_of as _run_id
from trainwarden.collector.store import models as m


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
        row = incident_row(conn, incident_id)
        if row.run_id != run_id:
            raise Invalid(f"incident {incident_id} is of run {row.run_name!r}, not {run!r}")
        if row.state == "merged":
            incident_id = row.merged_into
    else:
        incident_id = open_incident_of(conn, run_id)
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
