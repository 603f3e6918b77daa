"""HTTP routes for alerts: list and read them with their delivery attempts, acknowledge
them (``/api/v1/alerts``), and silence them (``/api/v1/silences``)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query

from trainwarden.collector.alerting import service
from trainwarden.collector.alerting.schemas import (
    AckIn,
    AlertOut,
    SilenceIn,
    SilenceOut,
    State,
)
from trainwarden.collector.api import auth
from trainwarden.collector.api.deps import EngineDep, admin
from trainwarden.collector.ingest.schema_checks import RowId
from trainwarden.collector.store.db import write

router = APIRouter(prefix="/api/v1/alerts", tags=["alerts"])
silences = APIRouter(prefix="/api/v1/silences", tags=["alerts"])


@router.get("", response_model=list[AlertOut])
def list_alerts(
    engine: EngineDep,
    run: str | None = None,
    state: Annotated[list[State] | None, Query()] = None,
    severity: str | None = None,
    rule: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> list[AlertOut]:
    """Alerts, newest first: pending and firing ones, and (``state=resolved``) the past."""
    with engine.connect() as conn:
        return service.list_alerts(
            conn, run=run, states=state, severity=severity, rule=rule, limit=limit
        )


@router.get("/{alert_id}", response_model=AlertOut)
def get_alert(alert_id: RowId, engine: EngineDep) -> AlertOut:
    """One alert with every delivery attempt to the notifiers."""
    with engine.connect() as conn:
        return service.get_alert(conn, alert_id=alert_id)


@router.post("/{alert_id}/ack", response_model=AlertOut, dependencies=[admin])
def ack_alert(alert_id: RowId, body: AckIn, engine: EngineDep) -> AlertOut:
    """Acknowledge: someone is on it. The alert stops being re-sent; it still resolves
    (and says so) when its condition clears. Acknowledging twice keeps the first."""
    with write(engine) as conn:
        return service.ack_alert(
            conn, alert_id=alert_id, by=auth.acting(body.by), comment=body.comment, now=time.time()
        )


@silences.post("", response_model=SilenceOut, status_code=201, dependencies=[admin])
def create_silence(body: SilenceIn, engine: EngineDep) -> SilenceOut:
    """Silence matching alerts for a while: they are still evaluated and listed, but
    nobody is paged for them."""
    with write(engine) as conn:
        return service.create_silence(
            conn, body=body, by=auth.acting(body.created_by), now=time.time()
        )


@silences.get("", response_model=list[SilenceOut])
def list_silences(engine: EngineDep, expired: bool = False) -> list[SilenceOut]:
    """Active and upcoming silences (``expired=true``: all of them)."""
    with engine.connect() as conn:
        return service.list_silences(conn, now=time.time(), expired=expired)


@silences.delete("/{silence_id}", response_model=SilenceOut, dependencies=[admin])
def expire_silence(silence_id: RowId, engine: EngineDep) -> SilenceOut:
    """End a silence now (it stays on record)."""
    with write(engine) as conn:
        return service.expire_silence(conn, silence_id=silence_id, now=time.time())
