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


def standing_places(conn: Connection, run_id: int) -> dict[int, dict[str, Any]]:
    """Where the run's standing collective verdict places each rank it names: the newest
    ``hang_verdict`` (a culprit or a desync) of the current attempt, for each rank that
    has started no step since the hang began (one that has, got past it). The verdict,
    not the order in which the ranks stopped or said goodbye, decides who is the culprit:
    a victim's collective that fails once the culprit is gone ends its step in an error,
    and its state may have moved on before its goodbye or its death is seen."""
    e, a, st = m.events.c, m.attempts.c, m.rank_steps.c
    began = select(func.max(a.started_at)).where(a.run_id == run_id).scalar_subquery()
    found = conn.execute(
        select(e.data)
        .where(
            e.run_id == run_id,
            e.kind == "hang_verdict",
            e.ts >= func.coalesce(began, 0.0),
        )
        .order_by(e.id.desc())
        .limit(1)
    ).scalar_one_or_none()
    verdict = dict(found or {})
    if verdict.get("kind") not in ("culprit", "desync") or not verdict.get("summary"):
        return {}
    since = float(verdict.get("hang_started") or 0.0)
    culprits = [int(r) for r in verdict.get("culprits") or ()]
    named = {r: "culprit" for r in culprits}
    named.update({int(r): "victim" for r in verdict.get("victims") or () if r not in named})
    moved_on = set(
        conn.execute(
            select(st.rank)
            .where(st.run_id == run_id, st.rank.in_(list(named)), st.ts > since)
            .distinct()
        ).scalars()
    )
    places: dict[int, dict[str, Any]] = {}
    for rank, role in named.items():
        if rank in moved_on:
            continue
        place: dict[str, Any] = {"role": role, "collective": verdict["summary"], "since": since}
        if role == "victim":
            place["waiting_on"] = culprits
        places[rank] = place
    return places


def goodbye(
    state: str | None,
    detail: Mapping[str, Any] | None,
    error: str | None,
    placed: Mapping[str, Any] | None = None,
    since: float | None = None,
    signalled_at: float | None = None,
) -> tuple[str, dict[str, Any] | None]:
    """A rank's state and detail once it said goodbye (``shutdown``); ``placed``: where the
    standing verdict places it (:func:`standing_places`), which wins over its state;
    ``since``: when it entered ``state``; ``signalled_at``: when a SIGTERM reached it (both
    on the collector's clock). A rank hung with no verdict yet (the job torn down before
    the health pass stored one) ends ``failed`` marked ``hung_at_end``: the health pass
    places it once it decides (its ``place_ended``). A rank found hung only after its
    SIGTERM came was not hung when the job was stopped: its teardown stalled it (a peer
    that left first, a slow flush), and it ends as its goodbye says."""
    if placed is not None:
        reason = (detail or {}).get("reason") if in_verdict(state, detail) else None
        return "failed", {**placed, "reason": f"ended while hung: {reason or placed['role']}"}
    if in_verdict(state, detail):
        assert detail is not None
        kept = {key: detail[key] for key in VERDICT_KEYS if key in detail}
        return "failed", {**kept, "reason": f"ended while hung: {detail.get('reason')}"}
    stalled_by_teardown = signalled_at is not None and since is not None and since >= signalled_at
    if state == "hung" and not stalled_by_teardown:
        said = (detail or {}).get("reason")
        return "failed", {
            "hung_at_end": True,
            "hung_since": since,
            "reason": f"ended while hung: {said}",
        }
    if error:
        return "failed", {"reason": error}
    return "finished", None


def said_end(conn: Connection, run_id: int, rank: int, reason: Any) -> None:
    """A rank that ended in a verdict says how (its ``attempt_end`` reason): kept in its
    detail, for the page's "the job was torn down"."""
    k = m.ranks.c
    where = (k.run_id == run_id) & (k.rank == rank)
    row = conn.execute(select(k.state, k.state_detail).where(where)).first()
    detail = row.state_detail or {} if row is not None else {}
    if (
        row is not None
        and row.state == "failed"
        and (detail.get("collective") or detail.get("hung_at_end"))
    ):
        conn.execute(
            update(m.ranks).where(where).values(state_detail={**row.state_detail, "ended": reason})
        )


def placed_at_end(detail: Mapping[str, Any], verdict_detail: Mapping[str, Any]) -> dict[str, Any]:
    """The detail of a rank that ended hung (``hung_at_end``) once the verdict placed it
    (``verdict_detail``: its detail as the verdict left it)."""
    kept = {key: verdict_detail[key] for key in VERDICT_KEYS if key in verdict_detail}
    out = {**kept, "reason": f"ended while hung: {verdict_detail.get('reason')}"}
    if "ended" in detail:
        out["ended"] = detail["ended"]
    return out


def settle_run(conn: Connection, run_id: int) -> None:
    """The status of a run whose ranks have all said goodbye, again (a verdict came after
    the goodbyes)."""
    k = m.ranks.c
    states = list(conn.execute(select(k.state).where(k.run_id == run_id)).scalars())
    world = conn.execute(select(m.runs.c.world_size).where(m.runs.c.id == run_id)).scalar()
    if states and len(states) >= (world or 0) and all(s in ("finished", "failed") for s in states):
        status = run_outcome(conn, run_id)[0]
        conn.execute(update(m.runs).where(m.runs.c.id == run_id).values(status=status))


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
    if not reasons:  # an agent that sends no attempt events: its ranks' goodbyes tell
        ended = {state for state, _ in ranks}
        reasons = ["completed"] if ranks and ended <= {"finished", "failed"} else [None]
    return outcome(reasons, verdict=verdict, failed=failed)


def story(conn: Connection, run_id: int) -> str | None:
    """The line that leads a run's post-mortem when its job ended in a collective verdict
    or a crash: the verdict and how the job ended; ``None`` otherwise."""
    status, detail = run_outcome(conn, run_id)
    return None if detail in OUTCOMES.values() else f"{status}: {detail}"
