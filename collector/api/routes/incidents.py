"""HTTP routes for incidents, the operator logbook, timelines and post-mortem reports."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response

from trainwarden.collector.api import auth
from trainwarden.collector.api.deps import EngineDep, SettingsDep, admin
from trainwarden.collector.incidents import notes
from trainwarden.collector.incidents import store as svc
from trainwarden.collector.incidents.postmortem import render, report_of
from trainwarden.collector.incidents.schemas import (
    CloseIn,
    IncidentOut,
    MergeIn,
    NoteIn,
    NoteOut,
    OpenIn,
    RetitleIn,
)
from trainwarden.collector.incidents.timeline import timeline
from trainwarden.collector.ingest.schema_checks import INT64_MAX, RowId
from trainwarden.collector.store.db import write

router = APIRouter(prefix="/api/v1/incidents", tags=["incidents"])
of_runs = APIRouter(prefix="/api/v1/runs/{run}", tags=["incidents"])


@of_runs.get("/incidents", response_model=list[IncidentOut])
def list_incidents(run: str, engine: EngineDep, merged: bool = False) -> list[IncidentOut]:
    """A run's incidents, oldest first (``merged=true``: also those merged into another)."""
    with engine.connect() as conn:
        return [IncidentOut(**i) for i in svc.list_incidents(conn, run=run, merged=merged)]


@router.get("/{incident_id}", response_model=IncidentOut)
def get_incident(incident_id: RowId, engine: EngineDep) -> IncidentOut:
    """One incident with the ids of its alerts and actions and its history."""
    with engine.connect() as conn:
        return IncidentOut(**svc.get_incident(conn, incident_id=incident_id))


@router.post("", response_model=IncidentOut, status_code=201, dependencies=[admin])
def open_incident(body: OpenIn, engine: EngineDep) -> IncidentOut:
    """Open an incident by hand; it stays open until someone closes it."""
    with write(engine) as conn:
        new_id = svc.open_incident(
            conn,
            run=body.run,
            title=body.title,
            by=auth.acting(body.by),
            alert_ids=body.alerts,
            at=body.at,
            now=time.time(),
        )
        return IncidentOut(**svc.get_incident(conn, incident_id=new_id))


@router.post("/{incident_id}/close", response_model=IncidentOut, dependencies=[admin])
def close_incident(incident_id: RowId, body: CloseIn, engine: EngineDep) -> IncidentOut:
    """Close an open incident now (with a one-line summary for the report)."""
    with write(engine) as conn:
        svc.close_incident(
            conn,
            incident_id=incident_id,
            by=auth.acting(body.by),
            summary=body.summary,
            now=time.time(),
        )
        return IncidentOut(**svc.get_incident(conn, incident_id=incident_id))


@router.post("/{incident_id}/merge", response_model=IncidentOut, dependencies=[admin])
def merge_incidents(incident_id: RowId, body: MergeIn, engine: EngineDep) -> IncidentOut:
    """Merge other incidents of the same run into this one."""
    with write(engine) as conn:
        svc.merge_incidents(
            conn,
            into=incident_id,
            sources=body.incidents,
            by=auth.acting(body.by),
            now=time.time(),
        )
        return IncidentOut(**svc.get_incident(conn, incident_id=incident_id))


@router.patch("/{incident_id}", response_model=IncidentOut, dependencies=[admin])
def retitle_incident(incident_id: RowId, body: RetitleIn, engine: EngineDep) -> IncidentOut:
    """Give an incident a better title."""
    with write(engine) as conn:
        svc.retitle_incident(
            conn,
            incident_id=incident_id,
            title=body.title,
            by=auth.acting(body.by),
            now=time.time(),
        )
        return IncidentOut(**svc.get_incident(conn, incident_id=incident_id))


@of_runs.post("/notes", response_model=NoteOut, status_code=201, dependencies=[admin])
def add_note(run: str, body: NoteIn, engine: EngineDep) -> NoteOut:
    """Add a note to the run's logbook (it joins the run's open incident by default)."""
    with write(engine) as conn:
        note = notes.add_note(
            conn,
            run=run,
            author=auth.acting(body.author),
            text=body.text,
            at=body.at,
            step=body.step,
            incident_id=body.incident,
            now=time.time(),
        )
    return NoteOut(**note)


@of_runs.get("/notes", response_model=list[NoteOut])
def list_notes(run: str, engine: EngineDep) -> list[NoteOut]:
    """The run's logbook, oldest first."""
    with engine.connect() as conn:
        return [NoteOut(**n) for n in notes.list_notes(conn, run=run)]


@of_runs.get("/timeline")
def get_timeline(
    run: str,
    engine: EngineDep,
    settings: SettingsDep,
    incident: Annotated[int | None, Query(ge=1, le=INT64_MAX)] = None,
    price: float | None = None,
) -> dict[str, Any]:
    """Ordered entries of one incident (with its derived figures: time to detect, page,
    act and recover; steps, GPU-hours and cost lost) or of the whole run."""
    with engine.connect() as conn:
        return timeline(
            conn,
            run=run,
            incident_id=incident,
            now=time.time(),
            price_per_gpu_hour=price if price is not None else settings.price_per_gpu_hour,
            base_url=settings.external_url or "",
        )


MEDIA = {
    "md": "text/markdown; charset=utf-8",
    "html": "text/html; charset=utf-8",
    "json": "application/json",
}


@of_runs.get("/postmortem", response_class=Response)
def get_postmortem(
    run: str,
    engine: EngineDep,
    settings: SettingsDep,
    format: Literal["md", "html", "json"] = "md",
    incident: Annotated[int | None, Query(ge=1, le=INT64_MAX)] = None,
    price: float | None = None,
    download: bool = False,
) -> Response:
    """The post-mortem report of a run (every incident, or ``incident``) as Markdown,
    a self-contained HTML page with charts, or JSON."""
    with engine.connect() as conn:
        report = report_of(
            conn,
            run=run,
            incident_id=incident,
            price_per_gpu_hour=price if price is not None else settings.price_per_gpu_hour,
            base_url=settings.external_url or "",
            charts=format != "md",
        )
    headers = {}
    if download:
        name = f"postmortem-{run}" + (f"-incident-{incident}" if incident is not None else "")
        headers["Content-Disposition"] = f'attachment; filename="{name}.{format}"'
    return Response(render(report, format), media_type=MEDIA[format], headers=headers)
