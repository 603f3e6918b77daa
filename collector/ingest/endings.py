"""How a job ended: ``finished``, ``stopped``, ``failed`` or ``lost``, from its
processes' own ``attempt_end`` reasons and whether a collective verdict stood.

- ``finished``: every process completed.
- ``stopped``: ended by SIGTERM (a scheduler's preemption, a time limit, an operator) or
  trainwarden's stop, while it trained: no process failed and no hang or desync verdict
  stood (the ranks were still completing steps when the signal came).
- ``failed``: a process ended on an exception, a rank died of a signal (its last words),
  or the job ended while its ranks were hung in a collective with the verdict out:
  torn down (SIGTERM to ranks stuck in a collective is a teardown, not a preemption) or
  killed (no goodbye). The detail is the verdict, and how the job ended.
- ``lost``: a process ended without a goodbye (SIGKILL, a node gone) and no cause is known.

A rank that says goodbye while it is in a verdict (its state detail names the collective:
culprit or victim) ends ``failed``, keeping its role: a victim torn down is a victim.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, func, select, update

from trainwarden.collector.ingest import crashes
from trainwarden.collector.store import models as m

OUTCOMES = {
    "finished": "every process completed",
    "stopped": "ended by SIGTERM or a stop while it trained: no hang, no error (a preemption)",
    "failed": "a process failed, a rank crashed, or the job ended hung in a collective",
    "lost": "a process ended without a goodbye and no cause is known",
}
VERDICT_KEYS = ("role", "waiting_on", "collective", "since")
"""What a rank's state detail keeps of a hang's verdict when the rank dies or ends."""
HOW = {
    "sigterm": "torn down (SIGTERM)",
    "stopped": "stopped by trainwarden",
    "exception": "ended on an exception",
    "completed": "ended",
    None: "killed (no goodbye)",
    "lost": "killed (no goodbye)",
}


def in_verdict(state: str | None, detail: Mapping[str, Any] | None) -> bool:
    """Whether a rank in ``state`` with ``detail`` is placed by a standing verdict."""
    detail = detail or {}
    return (
        state in ("hung", "dead")
        and detail.get("role") in ("culprit", "victim")
        and bool(detail.get("collective"))
    )


def goodbye(
    state: str | None, detail: Mapping[str, Any] | None, error: str | None
) -> tuple[str, dict[str, Any] | None]:
    """A rank's state and detail once it said goodbye (``shutdown``)."""
    if in_verdict(state, detail):
        assert detail is not None
        kept = {key: detail[key] for key in VERDICT_KEYS if key in detail}
        return "failed", {**kept, "reason": f"ended while hung: {detail.get('reason')}"}
    if error:
        return "failed", {"reason": error}
    return "finished", None


def said_end(conn: Connection, run_id: int, rank: int, reason: Any) -> None:
    """A rank that ended in a verdict says how (its ``attempt_end`` reason): kept in its
    detail, for the page's "the job was torn down"."""
    k = m.ranks.c
    where = (k.run_id == run_id) & (k.rank == rank)
    row = conn.execute(select(k.state, k.state_detail).where(where)).first()
    if row is not None and row.state == "failed" and (row.state_detail or {}).get("collective"):
        conn.execute(
            update(m.ranks).where(where).values(state_detail={**row.state_detail, "ended": reason})
        )


def outcome(
    reasons: Iterable[str | None], *, verdict: str | None = None, failed: bool = False
) -> tuple[str, str]:
    """A job's outcome from its processes' end reasons (``None``: no goodbye), the verdict
    standing at its end, and whether a rank failed (an exception, a crash)."""
    ends = list(reasons)
    how = next(
        (HOW[r] for r in ("sigterm", "stopped", None, "lost", "exception") if r in ends), "ended"
    )
    if verdict:
        return "failed", f"{verdict}; the job was {how}"
    if failed or "exception" in ends:
        return "failed", OUTCOMES["failed"]
    if None in ends or "lost" in ends:
        return "lost", OUTCOMES["lost"]
    if "sigterm" in ends or "stopped" in ends:
        return "stopped", OUTCOMES["stopped"]
    return "finished", OUTCOMES["finished"]


def run_outcome(conn: Connection, run_id: int) -> tuple[str, str]:
    """The outcome of the run's current attempt, from its ranks' rows and processes."""
    k, s, a = m.ranks.c, m.attempt_sessions.c, m.attempts.c
    ranks = conn.execute(select(k.state, k.state_detail).where(k.run_id == run_id)).all()
    verdict = next(
        (
            str(d["collective"])
            for state, d in ranks
            if state in ("failed", "dead") and d and d.get("collective") and d.get("role")
        ),
        None,
    )
    e = m.events.c
    crashed = conn.execute(
        select(e.rank, e.data)
        .where(
            e.run_id == run_id,
            e.kind == crashes.KIND,
            e.ts
            >= func.coalesce(
                select(func.max(a.started_at)).where(a.run_id == run_id).scalar_subquery(), 0.0
            ),
        )
        .order_by(e.id)
        .limit(1)
    ).first()
    if verdict is None and crashed is not None:  # no ring verdict: the crash is the story
        verdict = f"rank {crashed.rank} {crashes.line(dict(crashed.data or {}))}"
    newest = select(func.max(a.number)).where(a.run_id == run_id).scalar_subquery()
    reasons = list(
        conn.execute(select(s.end_reason).where(s.run_id == run_id, s.attempt == newest)).scalars()
    )
    failed = crashed is not None or any(state == "failed" for state, _ in ranks)
    return outcome(reasons or [None], verdict=verdict, failed=failed)


def story(conn: Connection, run_id: int) -> str | None:
    """The line that leads a run's post-mortem when its job ended in a collective verdict
    or a crash: the verdict and how the job ended; ``None`` otherwise."""
    status, detail = run_outcome(conn, run_id)
    return None if detail in OUTCOMES.values() else f"{status}: {detail}"
