"""Storms: many notifications of one rule, run and status in one pass go out as one
(a node's 8 ranks dying is one page), with stable labels so that the receiver updates and
resolves what fired. Pure functions of the notifications."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainwarden.alerts.lifecycle import fingerprint
from trainwarden.alerts.notification import Notification


def group_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """A storm group's labels: the rule's and the run's, without rank, node or GPU, and
    ``grouped="true"``; its fingerprint is of the rule and these, as every alert's is."""
    out = {k: v for k, v in labels.items() if k not in ("rank", "node", "gpu")}
    out["grouped"] = "true"
    return out


def group_note(members: list[Any]) -> Any:
    """One notification for ``members`` (notifications of one rule, run and status).

    Its labels (:func:`group_labels`) are the same whenever the group fires, grows or
    resolves, and so is its fingerprint, so that Alertmanager and PagerDuty update and
    resolve what fired. How many, and which ranks, are in its annotations (``alerts``,
    ``summary``). Its deliveries are recorded on the first alert's row."""
    first = members[0]
    rule, run, status = first.alertname, first.labels.get("run", ""), first.status
    labels = group_labels(first.labels)
    ranks = sorted({int(n.labels["rank"]) for n in members if n.labels.get("rank", "").isdigit()})
    who = f"{len(ranks):,} ranks ({_spans(ranks)})" if ranks else f"{len(members):,} alerts"
    annotations = {
        **first.annotations,
        "alerts": str(len(members)),
        "summary": f"{rule} on {who} of run {run}",
        "description": f"{len(members):,} {rule} alerts "
        f"{'firing' if status == 'firing' else 'resolved'} "
        f"together; the first: {first.annotations.get('description', '')}",
    }
    return Notification(
        alert_id=first.alert_id,
        fingerprint=fingerprint(rule, labels),
        status=status,
        labels=labels,
        annotations=annotations,
        starts_at=min(n.starts_at for n in members),
        ends_at=max(n.ends_at for n in members)
        if status == "resolved" and all(n.ends_at for n in members)
        else None,
        generator_url=first.generator_url,
    )


def grouped(notes: list[Any], *, over: int) -> list[Any]:
    """``notes`` with each set of more than ``over`` of one rule, run and status made one
    (:func:`group_note`)."""
    sets: dict[tuple[str, str, str], list[Any]] = {}
    for note in notes:
        sets.setdefault((note.alertname, note.labels.get("run", ""), note.status), []).append(note)
    out = []
    for members in sets.values():
        out += members if len(members) <= over else [group_note(members)]
    return out


def _spans(ranks: list[int], most: int = 8) -> str:
    """``0-7, 16, 24-31``: sorted ranks as runs, at most ``most`` of them, then "...".."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans[:most])
    return text + (", ..." if len(spans) > most else "")
