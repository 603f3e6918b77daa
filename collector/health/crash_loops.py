"""Crash loops: a job that restarts (torchrun ``--max-restarts``, a Slurm requeue, Ray's
``FailureConfig``) and fails the same way every time, burning an allocation an attempt.

Each health pass looks at the runs with at least ``attempts`` attempts begun within
``window_s``. An attempt is over once a later one has begun or each of its processes has
ended; it *crashed* if one of them ended on an exception, or without a goodbye (killed,
a node gone, a crash: ``lost``). Processes torn down by the launcher (SIGTERM) after a
peer failed are not the cause, and an attempt whose processes were all stopped by SIGTERM
(a preemption) or by trainwarden did not crash.

The newest ``attempts`` attempts that are over form a loop when each crashed, each after
the first got no further than the one before it (its furthest step at most
``slack_steps`` past the previous attempt's: the same step, from the start or from a
checkpoint) or failed within ``quick_s`` of its start, and all of them fit in
``window_s``. The loop's ``crash_loop`` event (once per attempt that completes one) names
what the attempts have in common: the rank, the node, the way it ended (the exception, the
exit code, the signal of its last words, or killed without a goodbye) and the step, of the
process that failed first in each attempt (its peers' failures follow from it). The
``CrashLoop`` rule pages on it; its action (``stop`` in the shipped pack) goes through
the action policy.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from trainwarden.collector.ingest import crashes
from trainwarden.collector.store import models as m

KIND = "crash_loop"
FAILED = ("exception", "lost")
"""Ways a process ends that make its attempt a crash (``None`` too, once the attempt is over:
it never said goodbye)."""


@dataclass(frozen=True)
class LoopSettings:
    attempts: int = 3
    """How many attempts in a row, each a crash, make a loop."""
    window_s: float = 3600.0
    """Within how long, from the first one's start to the newest one's end."""
    quick_s: float = 300.0
    """An attempt that failed this soon after it began counts as no progress, wherever it got."""
    slack_steps: int = 5
    """How many steps past the attempt before still count as no further: the processes a
    launcher tears down finish a step or two more, and a process killed without a goodbye
    is known up to its last flush."""


@dataclass
class _Attempt:
    number: int
    started_at: float
    reached: int  # its furthest step, -1 before any
    ended_at: float | None = None
    over: bool = False
    culprits: list[Any] | None = None  # the sessions that failed

    @property
    def crashed(self) -> bool:
        return bool(self.culprits)

    @property
    def first(self) -> Any:
        """The failed process that went first: the one its peers' failures follow (a peer
        killed by the launcher, or failing in a collective, ends after it). Its agent's
        heartbeats stop when it dies; a blocked peer's go on until it is torn down."""
        return min(
            self.culprits or (),
            key=lambda c: (c.ended_at or c.last_seen or 0.0, c.last_step or -1, c.rank),
        )


def _how(session: Any, crash: dict[str, Any] | None = None) -> str:
    """How a failed process ended, in words; ``crash``: its last words (a signal), if a
    survivor of its node sent them."""
    if crash is not None:
        signal = crash.get("signal") or crash.get("fatal") or "a fatal signal"
        where = f" in {crash['collective']}" if crash.get("collective") else ""
        return f"died of {signal}{where}"
    if session.end_reason == "exception":
        detail = f": {session.end_detail}" if session.end_detail else ""
        return f"ended on an exception{detail}"
    if session.exit_code is not None:
        return f"exited with code {session.exit_code}"
    return "killed (no goodbye)"


def _attempts(conn: Connection, run_id: int, since: float) -> list[_Attempt]:
    a, s = m.attempts.c, m.attempt_sessions.c
    rows = conn.execute(
        select(
            a.number,
            a.started_at,
            s.rank,
            s.session,
            s.host,
            s.ended_at,
            s.last_seen,
            s.last_step,
            s.end_reason,
            s.end_detail,
            s.exit_code,
        )
        .join(
            m.attempt_sessions,
            (s.run_id == a.run_id) & (s.attempt == a.number),
            isouter=True,
        )
        .where(a.run_id == run_id, a.started_at >= since)
        .order_by(a.number)
    ).all()
    sessions: dict[int, list[Any]] = defaultdict(list)
    started: dict[int, float] = {}
    for row in rows:
        started[row.number] = row.started_at
        if row.rank is not None:
            sessions[row.number].append(row)
    numbers = sorted(started)
    out = []
    for i, number in enumerate(numbers):
        mine = sessions[number]
        later = i + 1 < len(numbers)
        over = later or (bool(mine) and all(x.end_reason is not None for x in mine))
        ends = [x.ended_at or x.last_seen for x in mine if (x.ended_at or x.last_seen)]
        attempt = _Attempt(
            number=number,
            started_at=started[number],
            reached=max((x.last_step for x in mine if x.last_step is not None), default=-1),
            ended_at=max(ends) if ends else (started[numbers[i + 1]] if later else None),
            over=over,
        )
        if over and not any(x.end_reason == "stopped" for x in mine):
            # (an attempt trainwarden stopped did not crash: a peer that failed after its
            # stop, in a collective the stopped rank left, is the stop's doing)
            attempt.culprits = [
                x for x in mine if x.end_reason in FAILED or (x.end_reason is None and later)
            ]
        out.append(attempt)
    return out


def _last_words(conn: Connection, run_id: int, since: float) -> dict[str, dict[str, Any]]:
    """The run's crashed processes' last words (``rank_crashed``), by session."""
    e = m.events.c
    rows = conn.execute(
        select(e.data)
        .where(e.run_id == run_id, e.kind == crashes.KIND, e.ts >= since)
        .order_by(e.id)
        .limit(1000)
    ).scalars()
    return {str(d["session"]): d for d in rows if isinstance(d, dict) and d.get("session")}


def _common(values: list[set[Any]]) -> list[Any]:
    shared = set.intersection(*values) if values else set()
    return sorted(v for v in shared if v is not None)


def find(
    conn: Connection, run_id: int, *, now: float, settings: LoopSettings | None = None
) -> list[dict[str, Any]]:
    """The ``crash_loop`` event of the run's newest attempts, if they are a loop (its uid
    makes it once per attempt that completes one)."""
    settings = settings or LoopSettings()
    a = m.attempts.c
    since = now - settings.window_s
    begun = conn.execute(
        select(func.count()).where(a.run_id == run_id, a.started_at >= since)
    ).scalar_one()
    if begun < settings.attempts:
        return []
    over = [x for x in _attempts(conn, run_id, since) if x.over]
    loop = over[-settings.attempts :]
    if len(loop) < settings.attempts or not all(x.crashed for x in loop):
        return []
    for previous, attempt in zip(loop, loop[1:], strict=False):
        quick = (
            attempt.ended_at is not None
            and attempt.ended_at - attempt.started_at <= settings.quick_s
        )
        if attempt.reached > previous.reached + settings.slack_steps and not quick:
            return []  # it got further: a slow crash, not a loop
    last_end = loop[-1].ended_at or now
    if last_end - loop[0].started_at > settings.window_s:
        return []
    ranks = _common([{x.first.rank} for x in loop])
    nodes = _common([{x.first.host} for x in loop])
    words = _last_words(conn, run_id, since)
    ways = _common([{_how(x.first, words.get(x.first.session))} for x in loop])
    steps = [x.reached if x.reached >= 0 else None for x in loop]
    numbers = [x.number for x in loop]
    said = [f"attempts {numbers[0]}-{numbers[-1]} each failed"]
    if len(set(steps)) == 1:
        said.append("before any step" if steps[0] is None else f"at step {steps[0]}, no further")
    else:
        reached = ", ".join("none" if s is None else str(s) for s in steps)
        said.append(f"without getting past the attempt before (steps {reached})")
    parts = []
    if ranks:
        parts.append("rank " + ", ".join(map(str, ranks)))
    if nodes:
        parts.append("on node " + ", ".join(nodes))
    if ways:
        parts.append(" / ".join(ways))
    reason = " ".join(said) + (
        "; each time " + " ".join(parts)
        if parts
        else "; they have no rank, node or way of failing in common"
    )
    return [
        {
            "uid": f"{KIND}:{run_id}:{numbers[-1]}",
            "kind": KIND,
            "rank": ranks[0] if len(ranks) == 1 else None,
            "step": steps[-1],
            "severity": "critical",
            "data": {
                "attempts": numbers,
                "steps": steps,
                "ranks": ranks,
                "nodes": nodes,
                "ways": ways,
                "reason": reason,
            },
        }
    ]
