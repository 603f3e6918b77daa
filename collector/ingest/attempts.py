"""Attempts: the process lifetimes of a run, written as the agents' events arrive.

Each rank's agent sends ``attempt_start`` (its identity: config, tags, data snapshot,
code version, environment, and the launcher's attempt key when there is one) as its
first event, and ``attempt_end`` (completed, exception, sigterm, stopped) when it ends
cleanly. Which attempt a process belongs to:

- with a key (``torchelastic:<run id>:<restart count>``, ``slurm:<job>:<restart>``, or
  ``TRAINWARDEN_ATTEMPT``): the attempt of that key, opened by the first rank to report it;
- without one: the newest attempt, unless this rank already has a process in it; then the
  rank was restarted, and its new process opens the next attempt (its peers join it).

A process that dies without a goodbye (a crash, SIGKILL, a node gone) is closed when its
rank comes back with a new session, from the last heartbeat and step the collector had
(reason ``lost``). Everything here runs only for these rare events and for a process's
first steps, never per step.
"""

from __future__ import annotations

import weakref
from typing import Any

from sqlalchemy import Connection, Engine, func, select, update

from trainwarden.collector.ingest.schema_events import EventIn
from trainwarden.collector.ingest.schemas import AgentInfo
from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import dialect_insert

END_REASONS = ("completed", "exception", "sigterm", "stopped")
"""What an ``attempt_end`` event may say; ``lost`` is the collector's, for no goodbye."""

_DETAIL_MAX = 1000


def _clip(value: Any, limit: int) -> str | None:
    return None if value is None else str(value)[:limit]


def _attempt_for(conn: Connection, run_id: int, rank: int, key: str | None, ts: float) -> int:
    """The number of the attempt a new process of ``rank`` belongs to (opening it if new)."""
    a = m.attempts.c
    if key is not None:
        found = conn.execute(
            select(a.number).where(a.run_id == run_id, a.key == key).order_by(a.number.desc())
        ).first()
        if found is not None:
            return int(found[0])
    else:
        newest = conn.execute(
            select(a.number, a.key).where(a.run_id == run_id).order_by(a.number.desc())
        ).first()
        if newest is not None and newest.key is None:
            s = m.attempt_sessions.c
            taken = conn.execute(
                select(func.count()).where(
                    s.run_id == run_id, s.attempt == newest.number, s.rank == rank
                )
            ).scalar_one()
            if not taken:
                return int(newest.number)
    number = (
        conn.execute(select(func.max(a.number)).where(a.run_id == run_id)).scalar_one() or 0
    ) + 1
    conn.execute(
        dialect_insert(conn, m.attempts).on_conflict_do_nothing(
            index_elements=["run_id", "number"]
        ),
        {"run_id": run_id, "number": number, "key": key, "started_at": ts, "nodes": []},
    )
    return number


def _dict(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) else None


def record_start(
    conn: Connection, run_id: int, agent: AgentInfo, event: EventIn, now: float
) -> None:
    """A process of ``agent.rank`` started: put it in its attempt, merge its identity."""
    data = event.data
    key = _clip(data.get("attempt"), 255)
    ts = agent.started_at or event.ts
    s = m.attempt_sessions.c
    if conn.execute(select(s.session).where(s.session == agent.session)).first() is not None:
        return  # told twice (a second agent in one process, a replay): the first stands
    where = agent.node or agent.host  # the scheduler's node name when the agent knows it
    number = _attempt_for(conn, run_id, agent.rank, key, ts)
    conn.execute(
        dialect_insert(conn, m.attempt_sessions).on_conflict_do_nothing(index_elements=["session"]),
        {
            "session": agent.session,
            "run_id": run_id,
            "attempt": number,
            "rank": agent.rank,
            "host": where,
            "started_at": ts,
        },
    )
    a = m.attempts.c
    row = conn.execute(
        select(a.id, a.started_at, a.nodes, a.env, a.config).where(
            a.run_id == run_id, a.number == number
        )
    ).one()
    env = _dict(data.get("env"))
    values: dict[str, Any] = {"started_at": min(row.started_at, ts)}
    nodes = list(row.nodes or [])
    if where not in nodes:
        values["nodes"] = [*nodes, where]
    tags = data.get("tags")
    identity = {
        "config": _dict(data.get("config")),
        "tags": [str(t) for t in tags] if isinstance(tags, list) else None,
        "data_snapshot": _clip(data.get("data_snapshot"), 1000),
        "code": _dict(data.get("code")),
    }
    # Rank 0's identity is the attempt's; another rank's fills what is still empty.
    if agent.rank == 0 or row.config is None:
        values.update({k: v for k, v in identity.items() if v is not None or agent.rank == 0})
    if env is not None and (agent.rank == 0 or row.env is None):
        values["env"] = env
        values["world_size"] = env.get("world_size") or agent.world_size
        values["packages_hash"] = _clip(env.get("packages_hash"), 64)
    elif row.env is None:
        values["world_size"] = agent.world_size
    packages = data.get("packages")
    if isinstance(packages, list) and packages:  # [] when rank 0 could not list them
        values["packages"] = [str(p) for p in packages]
    conn.execute(update(m.attempts).where(a.id == row.id).values(**values))


def record_end(conn: Connection, agent: AgentInfo, event: EventIn) -> None:
    """A process said goodbye: how it ended."""
    data = event.data
    reason = data.get("reason")
    s = m.attempt_sessions.c
    exit_code = data.get("exit_code")
    last_step = data.get("last_step")
    conn.execute(
        update(m.attempt_sessions)
        .where(s.session == agent.session)
        .values(
            ended_at=event.ts,
            last_seen=event.ts,
            end_reason=reason if reason in END_REASONS else "completed",
            end_detail=_clip(data.get("detail"), _DETAIL_MAX),
            exit_code=exit_code if isinstance(exit_code, int) else None,
            last_step=last_step if isinstance(last_step, int) else agent.last_step,
            last_step_end=agent.last_step_end,
        )
    )


def record_lost(conn: Connection, gone: list[dict[str, Any]]) -> None:
    """Ranks came back with a new process: close their previous processes that never
    said goodbye, with what the collector last had of them. ``gone``: rows of
    ``session``, ``last_seen``, ``last_step``, ``progress_at``."""
    s = m.attempt_sessions.c
    for row in gone:
        conn.execute(
            update(m.attempt_sessions)
            .where(s.session == row["session"], s.end_reason.is_(None))
            .values(
                ended_at=row["last_seen"],
                last_seen=row["last_seen"],
                last_step=row["last_step"],
                last_step_end=row["progress_at"],
                end_reason="lost",
                end_detail="ended without a goodbye (crash, kill or node loss); "
                f"last heartbeat at step {row['last_step']}",
            )
        )
        # Whatever it said, its last heartbeat and step are the collector's to tell.
        conn.execute(
            update(m.attempt_sessions)
            .where(s.session == row["session"], s.last_step_end.is_(None))
            .values(last_step_end=row["progress_at"], last_step=row["last_step"])
        )


# Sessions whose first step is stored (or that never sent attempt_start): per database.
_started: weakref.WeakKeyDictionary[Engine, set[str]] = weakref.WeakKeyDictionary()
_MISSES = 3  # flushes with steps and no attempt row: an agent that does not send one
# Sessions with steps stored and no attempt row yet: the flushes that asked so far, and the
# earliest step seen (number, start time). A process's first steps can be stored a flush
# before its attempt_start (a relay's merged request, a batch that overtook another), and
# the step then recorded must be that one.
_waiting: weakref.WeakKeyDictionary[Engine, dict[str, tuple[int, tuple[int, float]]]] = (
    weakref.WeakKeyDictionary()
)


def sessions_started(engine: Engine) -> set[str]:
    """The sessions :func:`record_first_steps` needs to hear of no more."""
    return _started.setdefault(engine, set())


def record_first_steps(conn: Connection, firsts: dict[str, tuple[int, float]]) -> None:
    """The first step (number, start time) each new process ran: once per session."""
    done = _started.setdefault(conn.engine, set())
    todo = {k: v for k, v in firsts.items() if k not in done}
    if not todo:
        return
    s = m.attempt_sessions.c
    known = {
        row.session: row.first_step
        for row in conn.execute(select(s.session, s.first_step).where(s.session.in_(list(todo))))
    }
    waiting = _waiting.setdefault(conn.engine, {})
    for session, first in todo.items():
        misses, earliest = waiting.pop(session, (0, first))
        step, at = min(first, earliest)
        if session in known:
            if known[session] is None:
                conn.execute(
                    update(m.attempt_sessions)
                    .where(s.session == session, s.first_step.is_(None))
                    .values(first_step=step, first_step_at=at)
                )
            done.add(session)
        elif misses + 1 >= _MISSES:  # none in three flushes: an agent that sends none
            done.add(session)
        else:  # its attempt_start may still be on its way: ask again, a few times
            waiting[session] = (misses + 1, (step, at))
    if len(done) > 1_000_000:
        done.clear()
