"""Routing one pass's alerts, run by run (inhibition and grouping never cross runs):
silences, inhibition (an evicting alert quiets its node's others, a liveness alert its
rank's, a run-wide one its ranks'), storms of one rule and run paged as one
notification, and the notifications themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, or_, select

from trainwarden.alerts import fingerprint
from trainwarden.alerts.grouping import group_labels, group_note
from trainwarden.alerts.notification import Notification
from trainwarden.alerts.rules import action_kinds
from trainwarden.alerts.silences import silence_matches
from trainwarden.collector.alerting.writes import Writes
from trainwarden.collector.store import models as m

OPEN = ("pending", "firing")
"""The states of an open alert episode."""


@dataclass
class _Entry:
    """An alert in a routing pass: what to send for it, and what to change on its row."""

    row: Any
    labels: dict[str, str]
    status: str | None = None  # "firing" or "resolved" to notify; None: nothing
    quiet: bool = False  # silenced or inhibited
    changes: dict[str, Any] = field(default_factory=dict)


def route(
    conn: Connection,
    now: float,
    notes: list[Any],
    resting: set[int],
    *,
    resend_s: float,
    group_over: int,
    external_url: str | None,
) -> int:
    """Silences, inhibition and notifications of the alerts of the runs not ``resting``
    (routing is per run: inhibition and grouping never cross runs)."""
    a = m.alerts.c
    query = (
        select(m.alerts, m.runs.c.name.label("run_name"))
        .join(m.runs, m.runs.c.id == a.run_id)
        .where(or_(a.state.in_(OPEN), (a.state == "resolved") & (a.notified == "firing")))
    )
    if resting:
        query = query.where(a.run_id.not_in(resting))
    rows = conn.execute(query).all()
    if not rows:
        return 0
    si = m.silences.c
    silences = conn.execute(
        select(si.id, si.matchers).where(si.starts_at <= now, si.ends_at > now)
    ).all()
    # Inhibition sources: firing evict-action alerts per (run, node); firing liveness per (run,
    # rank).
    evicting: dict[tuple[int, str], int] = {}
    liveness: dict[tuple[int, int], int] = {}
    whole: dict[int, int] = {}  # a run's firing run-wide alert that explains its ranks'
    for r in rows:
        if r.state != "firing":
            continue
        if "evict" in action_kinds(r.action) and r.node:
            evicting.setdefault((r.run_id, r.node), r.id)
        if (r.labels or {}).get("category") == "liveness" and r.rank is not None:
            liveness.setdefault((r.run_id, r.rank), r.id)
        if (r.labels or {}).get("inhibits") == "ranks" and r.rank is None:
            whole.setdefault(r.run_id, r.id)
    entries: list[_Entry] = []
    for r in rows:
        labels = _full_labels(r)
        silenced = next((s.id for s in silences if silence_matches(s.matchers, labels)), None)
        inhibited = whole.get(r.run_id) if r.rank is not None else None
        if inhibited is None and "evict" not in action_kinds(r.action) and r.node:
            inhibited = evicting.get((r.run_id, r.node))
        if inhibited is None and r.rank is not None and labels.get("category") != "liveness":
            inhibited = liveness.get((r.run_id, r.rank))
        entry = _Entry(r, labels)
        if (silenced, inhibited) != (r.silenced_by, r.inhibited_by):
            entry.changes.update(silenced_by=silenced, inhibited_by=inhibited)
        entry.quiet = quiet = silenced is not None or inhibited is not None
        if r.state == "firing" and not quiet:
            due = r.last_sent_at is None or (
                r.acked_at is None and now - r.last_sent_at >= resend_s
            )
            if r.notified != "firing" or due:
                entry.status = "firing"
        elif r.state == "resolved" and r.notified == "firing":
            entry.status = "resolved"
        entries.append(entry)
    sets: dict[tuple[str, int], list[_Entry]] = {}
    for entry in entries:
        sets.setdefault((entry.row.rule, entry.row.run_id), []).append(entry)
    for members in sets.values():
        notes += _storm(members, now, group_over=group_over, external_url=external_url)
    sent = 0
    writes = Writes()
    for entry in entries:
        if entry.changes:
            writes.updates.append({"b_id": entry.row.id, **entry.changes})
            sent += "notified" in entry.changes
    writes.flush(conn)
    return sent


def _storm(
    entries: list[_Entry], now: float, *, group_over: int, external_url: str | None
) -> list[Any]:
    """The notifications of one rule and run's alerts in this pass, storm or not.

    More than ``group_over`` alerts to page at once are one notification (their
    group's: :func:`group_note`), and alerts that fire while their group is still
    open join it: the group's notification is sent again with them (Alertmanager
    and PagerDuty update the page they have, by its fingerprint; nothing pages
    twice). An alert is resolved under the fingerprint it was paged under: its own,
    or, once none of its group is firing any more, the group's."""
    over = group_over
    gfp = fingerprint(entries[0].row.rule, group_labels(entries[0].labels))
    in_group = [e for e in entries if e.row.notified == "firing" and e.row.notified_as == gfp]
    firing = [e for e in entries if e.status == "firing"]
    fresh = [e for e in firing if e.row.notified != "firing"]
    alone = [e for e in firing if e.row.notified == "firing" and e.row.notified_as != gfp]
    still = [e for e in in_group if e.row.state == "firing"]  # the group's open members
    notes: list[Any] = []
    group_due = any(e.status == "firing" for e in in_group)
    if group_due or (fresh and (still or len(fresh) > over)):
        members = [e for e in still if not e.quiet] + fresh  # silenced: not paged again
        notes.append(
            group_note([_notification(e.row, e.labels, "firing", external_url) for e in members])
        )
        for e in members:  # one resend of the group, not one per member
            e.changes.update(notified="firing", notified_as=gfp, last_sent_at=now)
    else:
        alone += fresh
    for e in alone:
        notes.append(_notification(e.row, e.labels, "firing", external_url))
        e.changes.update(notified="firing", notified_as=e.row.fingerprint, last_sent_at=now)
    resolving = [e for e in entries if e.status == "resolved"]
    ended = [e for e in resolving if e.row.notified_as == gfp]
    # The others (``e not in ended`` compared whole entries: quadratic in a storm's
    # thousands of alerts, a fifth of the alert thread's time past capacity).
    for e in resolving:
        if e.row.notified_as != gfp:
            notes.append(_notification(e.row, e.labels, "resolved", external_url))
            e.changes.update(notified="resolved", last_sent_at=now)
    # A group's members that end while it is still open wait, paged as firing, for
    # its resolve, which then names every one of them (not those of its last pass).
    if ended and not any(e.changes.get("notified_as") == gfp for e in entries) and not still:
        notes.append(
            group_note([_notification(e.row, e.labels, "resolved", external_url) for e in ended])
        )
        for e in ended:
            e.changes.update(notified="resolved", last_sent_at=now)
    return notes


def _full_labels(r: Any) -> dict[str, str]:
    labels = {
        **(r.labels or {}),
        "alertname": r.rule,
        "severity": r.severity,
        "run": r.run_name,
    }
    for key in ("node", "gpu"):
        if getattr(r, key) is not None:
            labels[key] = str(getattr(r, key))
    return labels


def _notification(r: Any, labels: dict[str, str], status: str, external_url: str | None) -> Any:
    base = (external_url or "").rstrip("/")
    return Notification(
        alert_id=r.id,
        fingerprint=r.fingerprint,
        status=status,  # type: ignore[arg-type]
        labels=labels,
        annotations=dict(r.annotations or {}),
        starts_at=r.fired_at or r.active_since,
        ends_at=r.resolved_at if status == "resolved" else None,
        generator_url=f"{base}/runs/{r.run_name}" if base else None,
    )
