"""Alerts and silences as operators see and change them: the API's routes and the web UI
call these (plain functions on a connection; refusals are ``store.errors``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, insert, select, update

from trainwarden.collector.alerting.schemas import (
    AlertOut,
    Delivery,
    Matcher,
    SilenceIn,
    SilenceOut,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.errors import Conflict, Invalid, NotFound


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


def _get(conn: Connection, alert_id: int) -> Any:
    row = conn.execute(_select().where(m.alerts.c.id == alert_id)).first()
    if row is None:
        raise NotFound(f"alert {alert_id} not found")
    return row


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


def list_alerts(
    conn: Connection,
    *,
    run: str | None = None,
    states: Sequence[str] | None = None,
    severity: str | None = None,
    rule: str | None = None,
    limit: int = 500,
) -> list[AlertOut]:
    """Alerts, newest first, filtered by run, states, severity and rule."""
    a = m.alerts.c
    query = _select()
    if run is not None:
        query = query.where(m.runs.c.name == run)
    if states:
        query = query.where(a.state.in_(list(states)))
    if severity is not None:
        query = query.where(a.severity == severity)
    if rule is not None:
        query = query.where(a.rule == rule)
    rows = conn.execute(query.order_by(a.active_since.desc(), a.id.desc()).limit(limit)).all()
    return [_out(r) for r in rows]


def get_alert(conn: Connection, *, alert_id: int) -> AlertOut:
    """One alert with every delivery attempt to the notifiers."""
    return _out(_get(conn, alert_id), deliveries_of(conn, alert_id))


def ack_alert(conn: Connection, *, alert_id: int, by: str, comment: str, now: float) -> AlertOut:
    """Acknowledge: someone is on it. Acknowledging twice keeps the first."""
    row = _get(conn, alert_id)
    if row.state == "resolved":
        raise Conflict(f"alert {alert_id} is already resolved")
    if row.acked_at is None:
        conn.execute(
            update(m.alerts)
            .where(m.alerts.c.id == alert_id)
            .values(acked_at=now, acked_by=by, ack_comment=comment or None)
        )
    return _out(_get(conn, alert_id))


def create_silence(conn: Connection, *, body: SilenceIn, by: str, now: float) -> SilenceOut:
    """A silence of the alerts matching ``body.matchers`` from its start to its end."""
    starts = body.starts_at if body.starts_at is not None else now
    ends = body.ends_at if body.ends_at is not None else starts + (body.duration_s or 0.0)
    if ends <= starts:
        raise Invalid("ends_at: the silence ends before it starts")
    if ends <= now:
        raise Invalid("ends_at: the silence would already be over")
    new_id = conn.execute(
        insert(m.silences)
        .values(
            matchers=[mt.model_dump() for mt in body.matchers],
            starts_at=starts,
            ends_at=ends,
            created_by=by,
            comment=body.comment,
            created_at=now,
        )
        .returning(m.silences.c.id)
    ).scalar_one()
    row = conn.execute(select(m.silences).where(m.silences.c.id == new_id)).one()
    return _silence_out(row, now)


def list_silences(conn: Connection, *, now: float, expired: bool = False) -> list[SilenceOut]:
    """Active and upcoming silences (``expired``: all of them), newest first."""
    s = m.silences.c
    query = select(m.silences).order_by(s.created_at.desc())
    if not expired:
        query = query.where(s.ends_at > now)
    return [_silence_out(r, now) for r in conn.execute(query)]


def expire_silence(conn: Connection, *, silence_id: int, now: float) -> SilenceOut:
    """End a silence now (it stays on record)."""
    s = m.silences.c
    row = conn.execute(select(m.silences).where(s.id == silence_id)).first()
    if row is None:
        raise NotFound(f"silence {silence_id} not found")
    if row.ends_at > now:
        conn.execute(update(m.silences).where(s.id == silence_id).values(ends_at=now))
    row = conn.execute(select(m.silences).where(s.id == silence_id)).one()
    return _silence_out(row, now)
