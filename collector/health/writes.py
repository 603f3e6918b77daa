"""What an evaluation writes: its events, each idempotent by its ``uid``
(``insert_events``), and the ranks' new states and details with a ``rank_state`` event
each (``write_states``).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import dialect_insert


def insert_events(
    conn: Connection, *, run_id: int, now: float, events: list[dict[str, Any]]
) -> None:
    """Insert events in one statement; ``uid`` makes each idempotent."""
    if events:
        conn.execute(
            dialect_insert(conn, m.events).on_conflict_do_nothing(index_elements=["uid"]),
            [
                {
                    **e,
                    "uid": uuid.uuid5(uuid.NAMESPACE_OID, e["uid"]).hex,
                    "run_id": run_id,
                    "ts": now,
                    "recv_ts": now,
                }
                for e in events
            ],
        )


def write_states(
    conn: Connection,
    *,
    run_id: int,
    ranks: Sequence[Any],
    states: Mapping[int, tuple[str, dict[str, Any]]],
    events: list[dict[str, Any]],
    now: float,
) -> tuple[int, list[dict[str, Any]]]:
    """Write the pass's verdicts on ``ranks`` (as the pass read them); returns how many
    ranks changed state, and ``events`` with a ``rank_state`` event for each."""
    # Decide everything first, then write in two statements in rank order: the rank
    # rows stay locked for as short a time as possible (ingest updates them too).
    details, changed = [], []
    for r in ranks:
        state, detail = states[r["rank"]]
        if state == r["state"]:  # same state: rewrite the detail only if its gist changed
            before = r["state_detail"] or {}
            if (detail.get("role"), detail.get("waiting_on"), detail.get("collective")) != (
                before.get("role"),
                before.get("waiting_on"),
                before.get("collective"),
            ):
                details.append({"b_rank": r["rank"], "detail": detail or None})
            continue
        changed.append(
            {
                "b_rank": r["rank"],
                "b_from": r["state"],
                "state": state,
                "detail": detail or None,
            }
        )
        severity = {"healthy": "info", "slow": "warning"}.get(state, "critical")
        events.append(
            dict(
                rank=r["rank"],
                kind="rank_state",
                severity=severity,
                uid=f"state:{run_id}:{r['rank']}:{state}:{now}",
                step=r["last_step"],
                data={"from": r["state"], "to": state, **detail},
            )
        )
    where = (m.ranks.c.run_id == run_id) & (m.ranks.c.rank == bindparam("b_rank"))
    if details:
        conn.execute(update(m.ranks).where(where).values(state_detail=bindparam("detail")), details)
    if changed:
        # Only from the state this pass read: a goodbye stored meanwhile (the rank
        # finished) is not overwritten with what the pass made of its last steps.
        conn.execute(
            update(m.ranks)
            .where(where, m.ranks.c.state == bindparam("b_from"))
            .values(state=bindparam("state"), state_since=now, state_detail=bindparam("detail")),
            changed,
        )
        k = m.ranks.c
        now_in: dict[int, str] = {
            rank: state
            for rank, state in conn.execute(
                select(k.rank, k.state).where(
                    k.run_id == run_id, k.rank.in_([c["b_rank"] for c in changed])
                )
            )
        }
        applied = [
            e
            for e in events
            if e["kind"] != "rank_state" or now_in.get(e["rank"]) == e["data"]["to"]
        ]
        events = applied
    return sum(1 for e in events if e["kind"] == "rank_state"), events
