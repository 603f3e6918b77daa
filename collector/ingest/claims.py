"""Who holds a rank: a second live process claiming a (run, rank) is a conflict, not a
restart.

A rank's row names the process session that holds it. A request from another session
of the same run and rank is one of three things, decided from the holder's row (read
once a flush with the others, by ``ranks.known_ranks``) and the newcomer's header:

- a **restart**, as before (``ranks.track_ranks`` records it): the holder said goodbye
  (its rank ``finished`` or ``failed``, or its ``attempt_end`` is stored), or it has been
  silent for more than :data:`WINDOW_BEATS` of its heartbeats (3 x 2 s by default: one
  late beat and a busy collector's delays are not a death);
- a **conflict** (409): the holder is within its window and was heard from after the
  newcomer's process started (its clock corrected by its skew), so both are alive at
  once: a double launch, ``RANK`` not set (every process says rank 0), or two jobs
  under one run name. The newcomer's batch is refused whole for that rank (steps,
  events, GPU samples, its heartbeat) and a ``rank_conflict`` event names both;
- **not yet known** (503, ``Retry-After: 1``): the holder is within its window but was
  last heard before the newcomer started: it may have just died (a fast restart) or be
  between two sends. Nothing is stored; the agent keeps the batch and sends it again,
  and the next answer is a restart once the holder's window has passed, or a conflict
  once it speaks again.

A request that arrived before the holder's newest stored one (a stale one, committed
late by a collector that was behind) is an old process's late request: its steps are
added and nothing of the rank changes, as before. Everything past the comparison of
sessions runs only when a session differs from its rank's holder: rare.
"""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from trainwarden.agent.wire import RANK_TAKEN
from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import dialect_insert

WINDOW_BEATS = 3.0
"""A holder heard from within this many of its heartbeats is alive (the health
evaluator calls a rank dead after 2.25; a restart waits at most this long)."""
DEFAULT_HEARTBEAT_S = 2.0  # the agent's default, for a header that does not say
ENDED_STATES = ("finished", "failed")  # a rank whose process said goodbye (shutdown)
WAIT_RETRY_S = 1
CONFLICT, WAIT = RANK_TAKEN, 503  # the agent stops sending on the first; retries the second


@dataclass(frozen=True)
class Refusal:
    """Why one rank's rows of one request were refused: its JSON answer (``body``)."""

    status: int  # CONFLICT or WAIT
    body: dict[str, Any]


def _holder_text(who: dict[str, Any]) -> str:
    where = who.get("node") or who.get("host") or "?"
    return f"pid {who.get('pid') or '?'} on {where} (session {str(who.get('session'))[:8]})"


def _clock(ts: Any) -> str:
    if not isinstance(ts, (int, float)) or not math.isfinite(ts):
        return "?"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def window_s(heartbeat_s: float | None) -> float:
    """How long a holder may be silent and still be alive."""
    return WINDOW_BEATS * (heartbeat_s or DEFAULT_HEARTBEAT_S)


def check(
    conn: Connection,
    *,
    run: str,
    run_id: int,
    heads: dict[str, list[Any]],
    found: Sequence[tuple[Any, ...]],
    batches: Sequence[IngestBatch | ColumnarBatch],
    now: float,
) -> dict[tuple[int, int], Refusal]:
    """The refused (batch index, rank) pairs of one run's headers in a flush.

    ``heads``: the run's headers column-wise in flush order, with ``arrived`` and
    ``origin`` (each row's batch index); ``found``: the stored rows of its ranks, as
    ``ranks.known_ranks`` reads them (rank, session, ..., last_seen at 3, heartbeat_s,
    state, pid, host, node from 6)."""
    ranks, sessions = heads["rank"], heads["session"]
    stored = {row[0]: row for row in found}
    # Each rank's claim: the stored holder, else the flush's first session for it.
    claim = dict(zip(reversed(ranks), reversed(sessions), strict=True))
    claim.update((rank, row[1]) for rank, row in stored.items())
    if set(zip(ranks, sessions, strict=True)) <= set(claim.items()):
        return {}  # every session holds its rank: the usual, at the cost of two sets
    arrived = heads["arrived"]
    # Each newcomer once (its first row in the flush), and when each holder was heard last.
    newcomers: dict[tuple[int, str], int] = {}
    heard: dict[int, float] = {rank: row[3] for rank, row in stored.items()}
    for k, (rank, session) in enumerate(zip(ranks, sessions, strict=True)):
        if claim[rank] == session:
            heard[rank] = max(heard.get(rank, arrived[k]), arrived[k])
        else:
            newcomers.setdefault((rank, session), k)
    holders = {claim[rank] for rank, _ in newcomers}
    ended, attempt = _attempts(conn, holders | {session for _, session in newcomers})
    out: dict[tuple[int, int], Refusal] = {}
    events: list[dict[str, Any]] = []
    for (rank, session), k in newcomers.items():
        row = stored.get(rank)
        if row is not None and arrived[k] < row[3]:
            continue  # stale: an old process's late request (module docstring)
        if row is not None and (row[7] in ENDED_STATES or claim[rank] in ended):
            continue  # the holder said goodbye: a restart
        first = ranks.index(rank)  # the holder's header, when it is new in this flush
        beat = row[6] if row is not None else heads["heartbeat_s"][first]
        if arrived[k] - heard[rank] > window_s(beat):
            continue  # the holder fell silent: a restart
        holder = _who(row, heads, first, claim[rank], attempt)
        newcomer = _who(None, heads, k, session, attempt)
        newcomer["attempt_key"] = _attempt_key_sent(batches[heads["origin"][k]], rank)
        sent, began = heads["sent_at"][k], heads["started_at"][k]
        skew = arrived[k] - sent if sent is not None else 0.0
        both_alive = began is None or heard[rank] > began + skew
        refusal = _refusal(run, rank, holder, newcomer, both_alive, arrived[k] - heard[rank])
        if both_alive:
            events.append(_event(run_id, rank, holder, newcomer, now))
        for j, (r, s) in enumerate(zip(ranks, sessions, strict=True)):
            if r == rank and s == session:
                out[(heads["origin"][j], rank)] = refusal
    if events:
        conn.execute(
            dialect_insert(conn, m.events).on_conflict_do_nothing(index_elements=["uid"]), events
        )
    return out


def _attempts(
    conn: Connection, sessions: set[str]
) -> tuple[set[str], dict[str, tuple[int, str | None, float]]]:
    """Of ``sessions``: those that said goodbye (attempt_end), and each known one's
    attempt (number, the launcher's key, its start)."""
    s, a = m.attempt_sessions.c, m.attempts.c
    rows = conn.execute(
        select(s.session, s.ended_at, s.end_reason, s.attempt, a.key, s.started_at)
        .select_from(
            m.attempt_sessions.outerjoin(
                m.attempts, (a.run_id == s.run_id) & (a.number == s.attempt)
            )
        )
        .where(s.session.in_(sorted(sessions)))
    ).all()
    # A process closed as lost was never heard to end: only its own goodbye counts.
    ended = {r.session for r in rows if r.ended_at is not None and r.end_reason != "lost"}
    return ended, {r.session: (r.attempt, r.key, r.started_at) for r in rows}


def _who(
    row: tuple[Any, ...] | None,
    heads: dict[str, list[Any]],
    k: int,
    session: str,
    attempt: dict[str, tuple[int, str | None, float]],
) -> dict[str, Any]:
    """A claimant as the event and the answer name it: from its stored rank row, else
    from its header at row ``k`` of the flush."""
    if row is not None:
        pid, host, node = row[8], row[9], row[10]
        seen = row[11]
    else:
        pid, host, node = heads["pid"][k], heads["host"][k], heads["node"][k]
        seen = heads["started_at"][k] or heads["arrived"][k]
    number, key, started = attempt.get(session, (None, None, None))
    return {
        "pid": pid,
        "host": host,
        "node": node or host,
        "session": session,
        "attempt": number,
        "attempt_key": key,
        # When the process started (its agent's clock), else when the collector first
        # heard of the rank.
        "first_seen": started if started is not None else seen,
    }


def _attempt_key_sent(batch: IngestBatch | ColumnarBatch, rank: int) -> str | None:
    """The launcher's attempt key a refused process sent in its attempt_start, if here."""
    agents = [batch] if isinstance(batch, IngestBatch) else batch.extras
    for b in agents:
        if b.agent.rank != rank:
            continue
        for e in b.events:
            if e.kind == "attempt_start" and isinstance(e.data.get("attempt"), str):
                return str(e.data["attempt"])
    return None


def _refusal(
    run: str,
    rank: int,
    holder: dict[str, Any],
    newcomer: dict[str, Any],
    both_alive: bool,
    silent_s: float,
) -> Refusal:
    who, me = _holder_text(holder), _holder_text(newcomer)
    if both_alive:
        detail = (
            f"run {run!r} rank {rank} is held by another live process, {who}, sending since "
            f"{_clock(holder['first_seen'])}; this process, {me}, is refused: two processes "
            "claim one rank (a double launch, RANK not set so that every process says rank 0, "
            "or two jobs under one run name). Stop the duplicate job, or give it a run name of "
            "its own (TRAINWARDEN_RUN)"
        )
        status = CONFLICT
    else:
        detail = (
            f"run {run!r} rank {rank} was held by {who}, heard from {silent_s:.1f} s ago: "
            "not yet known whether it ended (a restart) or still runs (a duplicate); send "
            "again later"
        )
        status = WAIT
    body: dict[str, Any] = {
        "detail": detail,
        "reason": "rank_conflict" if both_alive else "rank_claim_pending",
        "run": run,
        "rank": rank,
        "holder": {k: holder[k] for k in ("pid", "host", "node", "session")},
    }
    if not both_alive:
        body["retry_after"] = WAIT_RETRY_S
    return Refusal(status, body)


def _event(
    run_id: int, rank: int, holder: dict[str, Any], newcomer: dict[str, Any], now: float
) -> dict[str, Any]:
    first, second = _holder_text(holder), _holder_text(newcomer)
    return {
        # Derived from both sessions: one event a pair, however often the second sends.
        "uid": uuid.uuid5(
            uuid.NAMESPACE_OID, f"rank_conflict:{holder['session']}:{newcomer['session']}"
        ).hex,
        "run_id": run_id,
        "rank": rank,
        "step": None,
        "ts": now,
        "recv_ts": now,
        "kind": "rank_conflict",
        "severity": "critical",
        "data": {
            "reason": f"rank {rank} claimed by two live processes: {first} holds it, "
            f"{second} was refused",
            "first": holder,
            "second": newcomer,
        },
    }
