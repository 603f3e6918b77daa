"""A rank's last words (``rank_crashed`` events, ``agent/last_words.py``): how they read,
and where they go besides the event: the dead rank's state detail.

A survivor of the node sends the event on the dead rank's behalf, stored under that rank
(``EventIn.rank``). It is the rank's current crash while the rank's row still holds the
session that crashed (a restarted rank has a new session: its old crash is history).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, select, update

from trainwarden.collector.store import models as m

KIND = "rank_crashed"
LINE_CAUSE_CHARS = 400
"""The cause's length in a one-line summary (the event keeps it whole)."""


def line(data: dict[str, Any]) -> str:
    """One line: ``died of SIGABRT in all_reduce (train.py:42 in main) (last step seen:
    12): C++ exception gloo::EnforceNotMet: ... collective mismatch``."""
    sig = data.get("signal") or data.get("fatal") or "a fatal signal"
    text = f"died of {sig}"
    if data.get("collective"):
        text += f" in {data['collective']}"
    if data.get("where"):
        text += f" ({data['where']})"
    # The step its exporter thread last saw, up to a flush interval old: not "the step it
    # was in", which only the dead process knew.
    last = data.get("last_step")
    text += " before any step was seen" if last is None else f" (last step seen: {last})"
    cause = data.get("cause")
    if cause:
        cause = str(cause)
        if len(cause) > LINE_CAUSE_CHARS:
            cause = cause[: LINE_CAUSE_CHARS - 1] + "…"
        return f"{text}: {cause}"
    return f"{text} ({data.get('cause_note') or 'no C++ message kept'})"


def brief(rank: int, data: dict[str, Any], at: float | None = None) -> dict[str, Any]:
    """What a verdict or a rank's state detail carries of a crash."""
    return {
        "rank": rank,
        "at": at if at is not None else data.get("crashed_at"),
        "signal": data.get("signal"),
        "collective": data.get("collective"),
        "where": data.get("where"),
        "step": data.get("last_step"),
        "in_step": bool(data.get("in_step")),
        "cause": data.get("cause"),
        "cause_note": data.get("cause_note"),
        "stack": (data.get("stack") or [])[:8],
        "summary": line(data),
    }


def amend(detail: dict[str, Any] | None, rank: int, data: dict[str, Any]) -> dict[str, Any]:
    """A dead rank's state detail with its crash: the reason says what it died of."""
    out = dict(detail or {})
    out.setdefault("role", "culprit")
    silent = out.get("silent") or out.get("reason")
    if silent and not str(silent).startswith("died of"):
        out["silent"] = silent  # "no heartbeat for 5.1s", kept beside the cause
    out["reason"] = line(data)
    out["crash"] = brief(rank, data)
    return out


def current(
    conn: Connection, run_id: int, ranks: Iterable[int] | None = None
) -> dict[int, dict[str, Any]]:
    """Each rank's crash of its current session (the newest, if several): rank -> data,
    with ``at`` (when it crashed). ``ranks``: only these."""
    e, k = m.events.c, m.ranks.c
    where = [e.run_id == run_id, e.kind == KIND, e.rank.is_not(None)]
    if ranks is not None:
        wanted = sorted(set(ranks))
        if not wanted:
            return {}
        where.append(e.rank.in_(wanted))
    rows = conn.execute(
        select(e.rank, e.ts, e.data).where(*where).order_by(e.id.desc()).limit(1000)
    ).all()
    if not rows:
        return {}
    ranked = sorted({r.rank for r in rows})
    sessions = {
        r.rank: r.session
        for r in conn.execute(
            select(k.rank, k.session).where(k.run_id == run_id, k.rank.in_(ranked))
        )
    }
    out: dict[int, dict[str, Any]] = {}
    for r in rows:
        data = dict(r.data or {})
        if r.rank in out or sessions.get(r.rank) != data.get("session"):
            continue
        out[int(r.rank)] = {**data, "at": float(r.ts)}
    return out


def on_ingest(conn: Connection, run_id: int, rank: int, data: dict[str, Any]) -> None:
    """A crash that arrives once the rank is held dead (and still of the session that
    crashed): its state detail says why now. A rank not dead yet gets it from the health
    evaluator when it finds it dead (``health/evaluator.py``)."""
    k = m.ranks.c
    row = conn.execute(
        select(k.state_detail).where(
            k.run_id == run_id,
            k.rank == rank,
            k.state == "dead",
            k.session == str(data.get("session")),
        )
    ).first()
    if row is None:
        return
    conn.execute(
        update(m.ranks)
        .where(k.run_id == run_id, k.rank == rank, k.state == "dead")
        .values(state_detail=amend(row.state_detail, rank, data))
    )
