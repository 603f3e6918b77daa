"""Ranks that said goodbye while hung, before a verdict on the hang was stored: their
place in the verdict, decided on their Flight Recorder rings as for hung ranks."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, select, update

from trainwarden.collector.health import hang
from trainwarden.collector.health.writes import insert_events
from trainwarden.collector.ingest import endings
from trainwarden.collector.store import models as m

PLACE_ENDED_S = 120.0
"""How long after its goodbye a rank that ended hung, with no verdict yet, waits for one."""


def place_ended(conn: Connection, *, now: float) -> int:
    """Ranks that said goodbye while hung before a verdict was stored (a job torn down
    within a pass of its hang: endings.goodbye marks them ``hung_at_end``): decide the
    verdict on their rings as for hung ranks (:func:`hang.refine`), give each its place in
    it, store the verdict, and settle the run's status (an ended hang is ``failed``).
    Returns the ranks placed."""
    k = m.ranks.c
    # Only the ranks of runs touched lately (a goodbye touches its run): the runs table
    # is small, the ranks table may hold a hundred thousand rows.
    recent = select(m.runs.c.id).where(m.runs.c.updated_at >= now - PLACE_ENDED_S)
    ended = conn.execute(
        select(k.run_id, k.rank, k.state_detail, k.last_step)
        .where(
            k.run_id.in_(recent.scalar_subquery()),
            k.state == "failed",
            k.state_since >= now - PLACE_ENDED_S,
        )
        .order_by(k.run_id, k.rank)
    ).all()
    waiting: dict[int, list[Any]] = defaultdict(list)
    for row in ended:
        detail = row.state_detail or {}
        if detail.get("hung_at_end") and not detail.get("role"):
            waiting[row.run_id].append(row)
    placed = 0
    for run_id, rows in waiting.items():
        world = conn.execute(select(m.runs.c.world_size).where(m.runs.c.id == run_id)).scalar()
        states = {r.rank: ("hung", dict(r.state_detail)) for r in rows}
        as_hung = [
            {
                "rank": r.rank,
                "state": "hung",
                "state_since": r.state_detail.get("hung_since"),
                "last_step": r.last_step,
            }
            for r in rows
        ]
        dead = list(
            conn.execute(select(k.rank).where(k.run_id == run_id, k.state == "dead")).scalars()
        )
        events = hang.refine(
            conn,
            run_id=run_id,
            world=world or len(rows),
            ranks=as_hung,
            states=states,
            dead=dead,
            now=now,
        )
        for r in rows:
            verdict_detail = states[r.rank][1]
            if verdict_detail.get("role") not in ("culprit", "victim"):
                continue  # no verdict yet (no rings): again next pass, within the window
            conn.execute(
                update(m.ranks)
                .where(k.run_id == run_id, k.rank == r.rank)
                .values(state_detail=endings.placed_at_end(r.state_detail, verdict_detail))
            )
            placed += 1
        insert_events(conn, run_id=run_id, now=now, events=events)
        endings.settle_run(conn, run_id)
    return placed
