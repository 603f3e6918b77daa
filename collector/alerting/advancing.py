"""An alert's step through its lifecycle in one pass (``alerts.lifecycle.advance``) and
the change it makes to the alert's row, queued in the pass's ``Writes``: an alert the
pass found active (``advance_active``), and an open one it did not (``advance_stored``).
"""

from __future__ import annotations

from typing import Any

from trainwarden.alerts import Alert, Rule, advance
from trainwarden.alerts.intervals import ZERO
from trainwarden.alerts.snapshot import Snapshot, Verdict
from trainwarden.collector.alerting.writes import Writes, alert_of, finite_or_none
from trainwarden.collector.read.runbooks import runbook_url


def advance_active(
    writes: Writes,
    fp: str,
    row: Any,
    rule: Rule,
    v: Verdict,
    labels: dict[str, str],
    run: Any,
    snap: Snapshot,
    now: float,
    *,
    external_url: str | None,
    refresh_s: float,
) -> int:
    alert = alert_of(row) if row is not None else Alert(rule.name, labels)
    new = advance(
        alert,
        active=True,
        now=now,
        step=snap.last_step,
        for_=rule.for_,
        keep_firing_for=rule.keep_firing_for,
        verdict_step=v.step,
        onset_step=v.onset_step,
    )
    info = snap.ranks.get(v.rank) if v.rank is not None else None
    annotations = {
        **(v.annotations or {}),
        "summary": rule.summary,
        "description": v.detail,
        "runbook_url": runbook_url(external_url, rule.runbook),
    }
    fields = dict(
        state=new.state,
        active_since=new.active_since,
        active_since_step=new.active_since_step,
        onset_step=new.onset_step,
        fired_at=new.fired_at,
        fired_at_step=new.fired_at_step,
        cleared_at=new.cleared_at,
        cleared_at_step=new.cleared_at_step,
        resolved_at=new.resolved_at,
        value=finite_or_none(v.value),
        step=v.step,
        annotations=annotations,
        node=info.node if info else None,
        gpu=info.gpu if info else None,
    )
    if row is None:
        writes.inserts.append(
            dict(
                fingerprint=fp,
                rule=rule.name,
                run_id=run.id,
                rank=v.rank,
                severity=rule.severity,
                labels=labels,
                action=rule.action,
                updated_at=now,
                **fields,
            )
        )
        return 1
    same = (row.step, row.node, row.gpu) == (fields["step"], fields["node"], fields["gpu"])
    if new is alert and same:
        if row.value == fields["value"] and row.annotations == annotations:
            return 0
        # A hung rank's culprit named from the rings is news: written at once.
        named = (row.annotations or {}).get("collective") != annotations.get("collective")
        if not named and now - (row.updated_at or 0.0) < refresh_s:
            return 0  # only its value or description moved: written now and then
    writes.updates.append({"b_id": row.id, "updated_at": now, **fields})
    return int(new is not alert)


def advance_stored(
    writes: Writes,
    row: Any,
    rule: Rule | None,
    now: float,
    step: int | None,
    *,
    healed: bool = False,
) -> int:
    """An open alert whose condition this pass did not find. ``healed``: an action
    carried out since it fired dealt with it (:func:`healed_alerts`), so it resolves
    once its condition has cleared, without waiting out ``keep_firing_for`` (a hold
    against flapping, and for an instant event to stay in view: the action dealt with
    it, and the resolve tells on-call so)."""
    alert = alert_of(row)
    if rule is None or healed:  # a rule removed from the pack: nothing to wait for
        new = advance(alert, active=False, now=now, step=step, for_=ZERO, keep_firing_for=ZERO)
    else:
        new = advance(
            alert,
            active=False,
            now=now,
            step=step,
            for_=rule.for_,
            keep_firing_for=rule.keep_firing_for,
        )
    if new is alert:
        return 0
    if new.state == "inactive":  # pending that never fired: forgotten
        writes.deletes.append(row.id)
        return 1
    writes.updates.append(
        dict(
            b_id=row.id,
            state=new.state,
            cleared_at=new.cleared_at,
            cleared_at_step=new.cleared_at_step,
            resolved_at=new.resolved_at,
            updated_at=now,
        )
    )
    return 1
