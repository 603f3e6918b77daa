"""HTTP routes for alerts: list and read them with their delivery attempts, acknowledge
them, and silence them (``/api/v1/alerts``, ``/api/v1/silences``)."""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sqlalchemy import Connection, Engine, insert, select, update

from trainwarden.collector.api import auth
from trainwarden.collector.ingest.schemas import RowId
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

router = APIRouter(tags=["alerts"])
State = Literal["pending", "firing", "resolved"]


class Delivery(BaseModel):
    receiver: str
    kind: str
    status: str
    attempt: int
    ok: bool
    http_status: int | None
    error: str | None
    at: float
    duration_s: float
    final: bool


class AlertOut(BaseModel):
    id: int
    fingerprint: str
    rule: str
    run: str
    rank: int | None
    node: str | None
    gpu: str | None
    severity: str
    state: State
    labels: dict[str, str]
    annotations: dict[str, str]
    runbook_url: str | None
    value: float | None
    step: int | None
    action: str
    active_since: float
    fired_at: float | None
    # The step it fired at (``step``: the newest step its condition held at).
    fired_at_step: int | None = None
    # Where the anomaly began in the data (the first step of the rule's streak, or the
    # event's own step): what a rollback chooses its checkpoint by.
    onset_step: int | None = None
    resolved_at: float | None
    updated_at: float
    acked_at: float | None
    acked_by: str | None
    ack_comment: str | None
    silenced_by: int | None
    inhibited_by: int | None
    notified: str | None
    last_sent_at: float | None
    deliveries: list[Delivery] | None = None


class AckIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128, description="Who acknowledges")
    comment: str = Field(default="", max_length=1000)


class Matcher(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=64)
    value: str = Field(max_length=256)
    regex: bool = False

    @model_validator(mode="after")
    def _compiles(self) -> Matcher:
        if self.regex:
            try:
                re.compile(self.value)
            except re.error as exc:
                raise ValueError(
                    f"value {self.value!r} is not a regular expression: {exc}"
                ) from None
        return self


class SilenceIn(BaseModel):
    """Silence the alerts whose labels match every matcher (labels: alertname, severity,
    run, rank, node, gpu and the rule's own, e.g. category)."""

    model_config = ConfigDict(extra="forbid")
    matchers: list[Matcher] = Field(min_length=1, max_length=32)
    starts_at: float | None = Field(default=None, description="Epoch seconds; default now")
    ends_at: float | None = Field(default=None, description="Epoch seconds; or give duration_s")
    duration_s: float | None = Field(default=None, gt=0, le=90 * 86400)
    created_by: str = Field(min_length=1, max_length=128)
    comment: str = Field(
        min_length=1, max_length=1000, description="Why: read by whoever is paged next"
    )

    @field_validator("matchers")
    @classmethod
    def _not_everything(cls, value: list[Matcher]) -> list[Matcher]:
        if all(mt.regex and mt.value in (".*", ".+") for mt in value):
            raise ValueError("these matchers silence every alert; name the rule, run or rank")
        return value

    @model_validator(mode="after")
    def _one_end(self) -> SilenceIn:
        if (self.ends_at is None) == (self.duration_s is None):
            raise ValueError("give exactly one of ends_at and duration_s")
        return self


class SilenceOut(BaseModel):
    id: int
    matchers: list[Matcher]
    starts_at: float
    ends_at: float
    created_by: str
    comment: str
    created_at: float
    active: bool


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _out(row: Any, deliveries: list[Delivery] | None = None) -> AlertOut:
    annotations = dict(row.annotations or {})
    return AlertOut(
        id=row.id,
        fingerprint=row.fingerprint,
        rule=row.rule,
        run=row.run_name,
        rank=row.rank,
        node=row.node,
        gpu=row.gpu,
        severity=row.severity,
        state=row.state,
        labels={**(row.labels or {}), "alertname": row.rule, "severity": row.severity},
        annotations=annotations,
        runbook_url=annotations.get("runbook_url"),
        value=row.value,
        step=row.step,
        action=row.action,
        active_since=row.active_since,
        fired_at=row.fired_at,
        fired_at_step=row.fired_at_step,
        onset_step=row.onset_step,
        resolved_at=row.resolved_at,
        updated_at=row.updated_at,
        acked_at=row.acked_at,
        acked_by=row.acked_by,
        ack_comment=row.ack_comment,
        silenced_by=row.silenced_by,
        inhibited_by=row.inhibited_by,
        notified=row.notified,
        last_sent_at=row.last_sent_at,
        deliveries=deliveries,
    )


def _select() -> Any:
    return select(m.alerts, m.runs.c.name.label("run_name")).join(
        m.runs, m.runs.c.id == m.alerts.c.run_id
    )


def deliveries_of(conn: Connection, alert_id: int) -> list[Delivery]:
    d = m.alert_deliveries.c
    rows = conn.execute(
        select(m.alert_deliveries).where(d.alert_id == alert_id).order_by(d.at, d.id)
    ).all()
    return [
        Delivery(
            receiver=r.receiver,
            kind=r.kind,
            status=r.status,
            attempt=r.attempt,
            ok=bool(r.ok),
            http_status=r.http_status,
            error=r.error,
            at=r.at,
            duration_s=r.duration_s,
            final=bool(r.final),
        )
        for r in rows
    ]


@router.get("/api/v1/alerts", response_model=list[AlertOut])
def list_alerts(
    request: Request,
    run: str | None = None,
    state: Annotated[list[State] | None, Query()] = None,
    severity: str | None = None,
    rule: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> list[AlertOut]:
    """Alerts, newest first: pending and firing ones, and (``state=resolved``) the past."""
    a = m.alerts.c
    query = _select()
    if run is not None:
        query = query.where(m.runs.c.name == run)
    if state:
        query = query.where(a.state.in_(state))
    if severity is not None:
        query = query.where(a.severity == severity)
    if rule is not None:
        query = query.where(a.rule == rule)
    with _engine(request).connect() as conn:
        rows = conn.execute(query.order_by(a.active_since.desc(), a.id.desc()).limit(limit)).all()
    return [_out(r) for r in rows]


def _get(conn: Connection, alert_id: int) -> Any:
    row = conn.execute(_select().where(m.alerts.c.id == alert_id)).first()
    if row is None:
        raise NotFound(f"alert {alert_id} not found")
    return row


@router.get("/api/v1/alerts/{alert_id}", response_model=AlertOut)
def get_alert(alert_id: RowId, request: Request) -> AlertOut:
    """One alert with every delivery attempt to the notifiers."""
    with _engine(request).connect() as conn:
        return _out(_get(conn, alert_id), deliveries_of(conn, alert_id))


@router.post("/api/v1/alerts/{alert_id}/ack", response_model=AlertOut)
def ack_alert(alert_id: RowId, body: AckIn, request: Request) -> AlertOut:
    """Acknowledge: someone is on it. The alert stops being re-sent; it still resolves
    (and says so) when its condition clears. Acknowledging twice keeps the first."""
    auth.check_admin()  # the UI calls this function in-process
    with write(_engine(request)) as conn:
        row = _get(conn, alert_id)
        if row.state == "resolved":
            raise HTTPException(409, f"alert {alert_id} is already resolved")
        if row.acked_at is None:
            conn.execute(
                update(m.alerts)
                .where(m.alerts.c.id == alert_id)
                .values(
                    acked_at=time.time(),
                    acked_by=auth.acting(body.by),
                    ack_comment=body.comment or None,
                )
            )
        return _out(_get(conn, alert_id))


def _silence_out(row: Any, now: float) -> SilenceOut:
    return SilenceOut(
        id=row.id,
        matchers=[Matcher(**mt) for mt in row.matchers],
        starts_at=row.starts_at,
        ends_at=row.ends_at,
        created_by=row.created_by,
        comment=row.comment,
        created_at=row.created_at,
        active=row.starts_at <= now < row.ends_at,
    )


@router.post("/api/v1/silences", response_model=SilenceOut, status_code=201)
def create_silence(body: SilenceIn, request: Request) -> SilenceOut:
    """Silence matching alerts for a while: they are still evaluated and listed, but
    nobody is paged for them."""
    auth.check_admin()  # the UI calls this function in-process
    now = time.time()
    starts = body.starts_at if body.starts_at is not None else now
    ends = body.ends_at if body.ends_at is not None else starts + (body.duration_s or 0.0)
    if ends <= starts:
        raise HTTPException(422, "ends_at: the silence ends before it starts")
    if ends <= now:
        raise HTTPException(422, "ends_at: the silence would already be over")
    with write(_engine(request)) as conn:
        new_id = conn.execute(
            insert(m.silences)
            .values(
                matchers=[mt.model_dump() for mt in body.matchers],
                starts_at=starts,
                ends_at=ends,
                created_by=auth.acting(body.created_by),
                comment=body.comment,
                created_at=now,
            )
            .returning(m.silences.c.id)
        ).scalar_one()
        row = conn.execute(select(m.silences).where(m.silences.c.id == new_id)).one()
    return _silence_out(row, now)


@router.get("/api/v1/silences", response_model=list[SilenceOut])
def list_silences(request: Request, expired: bool = False) -> list[SilenceOut]:
    """Active and upcoming silences (``expired=true``: all of them)."""
    now = time.time()
    s = m.silences.c
    query = select(m.silences).order_by(s.created_at.desc())
    if not expired:
        query = query.where(s.ends_at > now)
    with _engine(request).connect() as conn:
        return [_silence_out(r, now) for r in conn.execute(query)]


@router.delete("/api/v1/silences/{silence_id}", response_model=SilenceOut)
def expire_silence(silence_id: RowId, request: Request) -> SilenceOut:
    """End a silence now (it stays on record)."""
    auth.check_admin()  # the UI calls this function in-process
    now = time.time()
    s = m.silences.c
    with write(_engine(request)) as conn:
        row = conn.execute(select(m.silences).where(s.id == silence_id)).first()
        if row is None:
            raise NotFound(f"silence {silence_id} not found")
        if row.ends_at > now:
            conn.execute(update(m.silences).where(s.id == silence_id).values(ends_at=now))
        row = conn.execute(select(m.silences).where(s.id == silence_id)).one()
    return _silence_out(row, now)
