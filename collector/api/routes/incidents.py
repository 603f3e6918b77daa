"""HTTP routes for incidents, the operator logbook, timelines and post-mortem reports."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Engine

from trainwarden.collector.api import auth
from trainwarden.collector.incidents import notes
from trainwarden.collector.incidents import store as svc
from trainwarden.collector.incidents.postmortem import render, report_of
from trainwarden.collector.incidents.timeline import timeline
from trainwarden.collector.ingest.schemas import INT64_MAX, MAX_STEP, RowId
from trainwarden.collector.store.db import write

router = APIRouter(tags=["incidents"])


class IncidentOut(BaseModel):
    id: int
    run: str
    title: str
    state: Literal["open", "closed", "merged"]
    severity: str
    auto: bool
    opened_at: float
    opened_by: str
    closed_at: float | None
    closed_by: str | None
    summary: str | None
    merged_into: int | None
    ranks: list[int]
    nodes: list[str]
    history: list[dict[str, Any]]
    alerts: list[int]
    actions: list[int]
    posted_at: float | None
    post_status: str | None
    updated_at: float


class OpenIn(BaseModel):
    """An operator opens an incident on a run."""

    model_config = ConfigDict(extra="forbid")
    run: str = Field(min_length=1, max_length=128)
    title: str = Field(min_length=1, max_length=200)
    by: str = Field(min_length=1, max_length=128)
    alerts: list[int] = Field(
        default_factory=list,
        max_length=1000,
        description="alerts of the run that belong to it (in no incident yet)",
    )
    at: float | None = Field(
        default=None,
        description="when it began (epoch s); default: its first alert went pending, else now",
    )


class CloseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128)
    summary: str | None = Field(
        default=None, max_length=2000, description="what happened, in a line"
    )


class MergeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128)
    incidents: list[Annotated[int, Field(ge=1, le=INT64_MAX)]] = Field(
        min_length=1, max_length=100, description="merged into this one"
    )


class RetitleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128)
    title: str = Field(min_length=1, max_length=200)


class NoteIn(BaseModel):
    """A note of the operator logbook."""

    model_config = ConfigDict(extra="forbid")
    author: str = Field(min_length=1, max_length=128)
    text: str = Field(min_length=1, max_length=10_000)
    at: float | None = Field(
        default=None, ge=0, le=4e9, description="what it is about (epoch s); default now"
    )
    step: int | None = Field(default=None, ge=0, le=MAX_STEP)
    incident: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="default: the run's open incident"
    )


class NoteOut(BaseModel):
    id: int
    run: str
    incident: int | None
    author: str
    text: str
    at: float
    step: int | None
    created_at: float


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _change(request: Request, fn: Any, shown: int, **kwargs: Any) -> IncidentOut:
    """Run one of the service's changes, mapping its domain errors to 409 / 422; answer
    with incident ``shown``."""
    with write(_engine(request)) as conn:
        try:
            fn(conn, now=time.time(), **kwargs)
        except svc.Conflict as exc:
            raise HTTPException(409, str(exc)) from None
        except svc.Invalid as exc:
            raise HTTPException(422, str(exc)) from None
        return IncidentOut(**svc.get_incident(conn, incident_id=shown))


@router.get("/api/v1/runs/{run}/incidents", response_model=list[IncidentOut])
def list_incidents(run: str, request: Request, merged: bool = False) -> list[IncidentOut]:
    """A run's incidents, oldest first (``merged=true``: also those merged into another)."""
    with _engine(request).connect() as conn:
        return [IncidentOut(**i) for i in svc.list_incidents(conn, run=run, merged=merged)]


@router.get("/api/v1/incidents/{incident_id}", response_model=IncidentOut)
def get_incident(incident_id: RowId, request: Request) -> IncidentOut:
    """One incident with the ids of its alerts and actions and its history."""
    with _engine(request).connect() as conn:
        return IncidentOut(**svc.get_incident(conn, incident_id=incident_id))


@router.post("/api/v1/incidents", response_model=IncidentOut, status_code=201)
def open_incident(body: OpenIn, request: Request) -> IncidentOut:
    """Open an incident by hand; it stays open until someone closes it."""
    auth.check_admin()  # the UI calls this function in-process
    with write(_engine(request)) as conn:
        try:
            new_id = svc.open_incident(
                conn,
                run=body.run,
                title=body.title,
                by=auth.acting(body.by),
                alert_ids=body.alerts,
                at=body.at,
                now=time.time(),
            )
        except svc.Conflict as exc:
            raise HTTPException(409, str(exc)) from None
        except svc.Invalid as exc:
            raise HTTPException(422, str(exc)) from None
        return IncidentOut(**svc.get_incident(conn, incident_id=new_id))


@router.post("/api/v1/incidents/{incident_id}/close", response_model=IncidentOut)
def close_incident(incident_id: RowId, body: CloseIn, request: Request) -> IncidentOut:
    """Close an open incident now (with a one-line summary for the report)."""
    auth.check_admin()  # the UI calls this function in-process
    return _change(
        request,
        svc.close_incident,
        incident_id,
        incident_id=incident_id,
        by=auth.acting(body.by),
        summary=body.summary,
    )


@router.post("/api/v1/incidents/{incident_id}/merge", response_model=IncidentOut)
def merge_incidents(incident_id: RowId, body: MergeIn, request: Request) -> IncidentOut:
    """Merge other incidents of the same run into this one."""
    auth.check_admin()  # the UI calls this function in-process
    return _change(
        request,
        svc.merge_incidents,
        incident_id,
        into=incident_id,
        sources=body.incidents,
        by=auth.acting(body.by),
    )


@router.patch("/api/v1/incidents/{incident_id}", response_model=IncidentOut)
def retitle_incident(incident_id: RowId, body: RetitleIn, request: Request) -> IncidentOut:
    """Give an incident a better title."""
    auth.check_admin()  # the UI calls this function in-process
    return _change(
        request,
        svc.retitle_incident,
        incident_id,
        incident_id=incident_id,
        title=body.title,
        by=auth.acting(body.by),
    )


@router.post("/api/v1/runs/{run}/notes", response_model=NoteOut, status_code=201)
def add_note(run: str, body: NoteIn, request: Request) -> NoteOut:
    """Add a note to the run's logbook (it joins the run's open incident by default)."""
    auth.check_admin()  # the UI calls this function in-process
    with write(_engine(request)) as conn:
        try:
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
        except svc.Invalid as exc:
            raise HTTPException(422, str(exc)) from None
    return NoteOut(**note)


@router.get("/api/v1/runs/{run}/notes", response_model=list[NoteOut])
def list_notes(run: str, request: Request) -> list[NoteOut]:
    """The run's logbook, oldest first."""
    with _engine(request).connect() as conn:
        return [NoteOut(**n) for n in notes.list_notes(conn, run=run)]


def _price(request: Request, price: float | None) -> float | None:
    return price if price is not None else request.app.state.settings.price_per_gpu_hour


@router.get("/api/v1/runs/{run}/timeline")
def get_timeline(
    run: str,
    request: Request,
    incident: Annotated[int | None, Query(ge=1, le=INT64_MAX)] = None,
    price: float | None = None,
) -> dict[str, Any]:
    """Ordered entries of one incident (with its derived figures: time to detect, page,
    act and recover; steps, GPU-hours and cost lost) or of the whole run."""
    with _engine(request).connect() as conn:
        return timeline(
            conn,
            run=run,
            incident_id=incident,
            now=time.time(),
            price_per_gpu_hour=_price(request, price),
            base_url=request.app.state.settings.external_url or "",
        )


MEDIA = {
    "md": "text/markdown; charset=utf-8",
    "html": "text/html; charset=utf-8",
    "json": "application/json",
}


@router.get("/api/v1/runs/{run}/postmortem", response_class=Response)
def get_postmortem(
    run: str,
    request: Request,
    format: Literal["md", "html", "json"] = "md",
    incident: Annotated[int | None, Query(ge=1, le=INT64_MAX)] = None,
    price: float | None = None,
    download: bool = False,
) -> Response:
    """The post-mortem report of a run (every incident, or ``incident``) as Markdown,
    a self-contained HTML page with charts, or JSON."""
    with _engine(request).connect() as conn:
        report = report_of(
            conn,
            run=run,
            incident_id=incident,
            price_per_gpu_hour=_price(request, price),
            base_url=request.app.state.settings.external_url or "",
            charts=format != "md",
        )
    headers = {}
    if download:
        name = f"postmortem-{run}" + (f"-incident-{incident}" if incident is not None else "")
        headers["Content-Disposition"] = f'attachment; filename="{name}.{format}"'
    return Response(render(report, format), media_type=MEDIA[format], headers=headers)
