"""Preflight verdicts: a ``preflight_failed`` event for each rank of the run's newest
attempt that failed its checks before step 0 (``collector/read/preflight.py`` judges).

A hard fault is said as soon as the rank's result is in; an outlier once every rank of
the world has sent its result, or ``WAIT_S`` after the first one (a rank that never
sends, say, is not waited for). Once an attempt is judged whole, its run is not read
again until a newer attempt begins. The ``PreflightFailed`` rule pages on the event, on
that rank: its node is named, and its action (``evict``) goes through the eviction
policy before the job spends hours there.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, Engine, exists, func, select

from trainwarden.collector.read import preflight as results
from trainwarden.collector.store import models as m

KIND = "preflight_failed"
WAIT_S = 120.0
"""How long after the first rank's result the outliers are judged without the rest."""

_judged: dict[Engine, dict[int, int | None]] = {}  # run -> its attempt judged whole


def ended_runs(conn: Connection, *, now: float) -> list[tuple[int, int]]:
    """Runs no longer running with a preflight received lately, (id, world size): a short
    job can end before its ranks' results were judged (the evaluator reads running runs
    only)."""
    e, ru = m.events.c, m.runs.c
    judged = _judged.get(conn.engine, {})
    return [
        (run_id, world)
        for run_id, world in conn.execute(
            select(ru.id, ru.world_size).where(
                ru.status != "running",
                exists().where(
                    e.run_id == ru.id, e.kind == results.KIND, e.recv_ts >= now - 2 * WAIT_S
                ),
            )
        )
        if run_id not in judged
    ]


def failures(
    conn: Connection, run_id: int, world: int, *, now: float, ended: bool = False
) -> list[dict[str, Any]]:
    """The run's ``preflight_failed`` events not said yet (their uid makes each once);
    ``ended``: the run is over, so every result that will come is in."""
    judged = _judged.setdefault(conn.engine, {})
    a = m.attempts.c
    newest = conn.execute(select(func.max(a.number)).where(a.run_id == run_id)).scalar()
    if run_id in judged and judged[run_id] == newest:
        return []
    attempt, ranks = results.newest(conn, run_id)
    if not ranks:
        return []
    whole = ended or len(ranks) >= world or now - min(r["ts"] for r in ranks.values()) >= WAIT_S
    if whole:
        judged[run_id] = attempt
    out = []
    for rank, r in results.judge(ranks, results.nodes_of(conn, run_id)).items():
        if not r["failed"] or not (whole or r.get("faults")):
            continue  # an outlier is one among its peers: judged once they are in
        out.append(
            {
                "uid": f"{KIND}:{run_id}:{attempt}:{rank}",
                "kind": KIND,
                "rank": rank,
                "step": None,
                "severity": "critical",
                "data": {
                    "attempt": attempt,
                    "reasons": r["reasons"],
                    "ratios": r["ratios"],
                    "device": r.get("device"),
                    "reason": f"rank {rank} failed preflight: " + "; ".join(r["reasons"]),
                },
            }
        )
    return out
