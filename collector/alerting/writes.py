"""What an alert pass writes: its new, changed and forgotten alerts in one statement
for each kind of change (``Writes``), and which firing alerts an action already dealt
with (``healed_alerts``); the notifiers' delivery attempts (``store_deliveries``)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, insert, select, update

from trainwarden.alerts import Alert
from trainwarden.collector.store import models as m


class Writes:
    """A pass's new, changed and forgotten alerts, written in one statement for each kind
    of change (an executemany): a job that dies whole brings thousands of RankDead alerts
    at once, and when it comes back they all resolve at once."""

    def __init__(self) -> None:
        self.inserts: list[dict[str, Any]] = []
        self.updates: list[dict[str, Any]] = []  # each: b_id (the alert's id) and its new values
        self.deletes: list[int] = []

    def flush(self, conn: Connection) -> None:
        if self.inserts:
            conn.execute(insert(m.alerts), self.inserts)
        a = m.alerts.c
        alike: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for u in self.updates:
            alike.setdefault(tuple(sorted(k for k in u if k != "b_id")), []).append(u)
        for names, rows in alike.items():
            conn.execute(
                update(m.alerts)
                .where(a.id == bindparam("b_id"))
                .values({k: bindparam(f"b_{k}", type_=a[k].type) for k in names}),
                [{"b_id": u["b_id"], **{f"b_{k}": u[k] for k in names}} for u in rows],
            )
        for i in range(0, len(self.deletes), 1000):  # SQLite caps a statement's parameters
            conn.execute(delete(m.alerts).where(a.id.in_(self.deletes[i : i + 1000])))
        self.inserts, self.updates, self.deletes = [], [], []


def healed_alerts(conn: Connection, firing: list[Any]) -> set[int]:
    """The ids of the ``firing`` alerts that an action carried out since they fired (done,
    not a dry run) dealt with: their own action, or, for a stability alert (the loss, the
    grad norm), a rollback of their run, which threw away the steps they fired on."""
    if not firing:
        return set()
    fired = {row.id: row.fired_at or 0.0 for row in firing}
    ac = m.actions.c
    carried_out = (ac.state == "done") & (ac.mode != "dry-run")
    ids = list(fired)
    done = [
        found
        for i in range(0, len(ids), 1000)  # SQLite caps a statement's parameters
        for found in conn.execute(
            select(ac.alert_id, ac.created_at).where(
                ac.alert_id.in_(ids[i : i + 1000]), carried_out
            )
        )
    ]
    healed = {alert_id for alert_id, created in done if created >= fired[alert_id]}
    stability = [row for row in firing if (row.labels or {}).get("category") == "stability"]
    if stability:
        rolled_back: dict[int, float] = dict(
            conn.execute(
                select(ac.run_id, func.max(ac.created_at))
                .where(
                    ac.run_id.in_(sorted({row.run_id for row in stability})),
                    ac.kind == "rollback",
                    carried_out,
                )
                .group_by(ac.run_id)
            ).all()
        )
        healed |= {
            row.id for row in stability if rolled_back.get(row.run_id, -1.0) >= fired[row.id]
        }
    return healed


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def alert_of(row: Any) -> Alert:
    return Alert(
        rule=row.rule,
        labels=dict(row.labels),
        state=row.state,
        active_since=row.active_since,
        active_since_step=row.active_since_step,
        onset_step=row.onset_step,
        fired_at=row.fired_at,
        fired_at_step=row.fired_at_step,
        cleared_at=row.cleared_at,
        cleared_at_step=row.cleared_at_step,
        resolved_at=row.resolved_at,
    )


def store_deliveries(conn: Connection, deliveries: deque[Any]) -> None:
    """Store the notifiers' delivery attempts (of alerts that still exist), taking them
    from ``deliveries``."""
    batch = []
    while deliveries:
        batch.append(deliveries.popleft())
    if not batch:
        return
    known = set(
        conn.execute(
            select(m.alerts.c.id).where(m.alerts.c.id.in_({d.alert_id for d in batch}))
        ).scalars()
    )
    rows = [
        dict(
            alert_id=d.alert_id,
            receiver=d.receiver,
            kind=d.kind,
            status=d.status,
            attempt=d.attempt,
            ok=int(d.ok),
            http_status=d.http_status,
            error=(d.error or None) and d.error[:1000],
            at=d.at,
            duration_s=d.duration_s,
            final=int(d.final),
        )
        for d in batch
        if d.alert_id in known
    ]
    if rows:
        conn.execute(insert(m.alert_deliveries), rows)
