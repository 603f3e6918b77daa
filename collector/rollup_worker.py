"""Roll steps up across ranks once, when they are complete, not on every rank's batch.

Ingest queues each (run, step) it writes in ``rollup_queue`` (insert-if-absent: no
row lock, so a step's ranks never wait on each other). The worker rolls a queued step
up when every rank of the run has reported it, or when ``grace_s`` has passed since
it was first queued (late or dead ranks), and records how many rows it saw and the
newest receive time. A late or replayed row changes one of those, and the step is
rolled up again. Steps leave the queue ``SETTLE_S`` after their last rollup.

One worker runs at a time: on PostgreSQL it takes an advisory lock, so any number of
collectors can run against one database without double work.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, func, select, text, tuple_, update

from . import models as m
from .db import is_sqlite, write
from .ingest import _insert, upsert
from .loops import Loop
from .rollups import aggregate

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_726F_6C6C  # "twroll"
GRACE_S = 5.0
SETTLE_S = 30.0  # a rolled-up step stays queued this long, to catch late and replayed rows
RECHECK_EVERY = 8  # passes between looks at already rolled-up steps (late rows, replays)
MAX_STEPS_PER_PASS = 2_000


def roll_up_ready(
    conn: Connection, *, now: float, grace_s: float = GRACE_S, recheck: bool = True
) -> int:
    """Roll up every queued step that is due: complete (or past its grace) and not yet
    rolled, or (``recheck``) rolled before a late or replayed row arrived. Returns how many."""
    q, s, r = m.rollup_queue.c, m.rank_steps.c, m.runs.c
    counts = (
        select(q.run_id, q.step, q.first_seen, q.rolled_n, q.rolled_at, r.world_size,
               func.count(s.rank).label("n"), func.max(s.recv_ts).label("newest"))
        .join(m.runs, r.id == q.run_id)
        .join(m.rank_steps, and_(s.run_id == q.run_id, s.step == q.step))
        .group_by(q.run_id, q.step, q.first_seen, q.rolled_n, q.rolled_at, r.world_size)
        .order_by(q.first_seen)
        .limit(MAX_STEPS_PER_PASS)
    )  # fmt: skip
    if not recheck:  # the cheap pass: only steps never rolled up
        counts = counts.where(q.rolled_n.is_(None))
    due = [
        row for row in conn.execute(counts)
        if (row.rolled_n is None and (row.n >= row.world_size or now - row.first_seen >= grace_s))
        or (row.rolled_n is not None and (row.n != row.rolled_n or row.newest > row.rolled_at))
    ]  # fmt: skip
    if due:
        keys = [(row.run_id, row.step) for row in due]
        rows = conn.execute(
            select(m.rank_steps).where(tuple_(s.run_id, s.step).in_(keys))
        ).mappings()
        groups: dict[tuple[int, int], list[Any]] = defaultdict(list)
        for row in rows:
            groups[(row["run_id"], row["step"])].append(row)
        stats = [
            stat
            for (run_id, step), group in groups.items()
            for stat in aggregate(run_id, step, group)
        ]
        upsert(conn, m.step_stats, stats, key=["run_id", "metric", "step"])
        _bucket_maxima(conn, groups)
        for (run_id, step), group in groups.items():
            conn.execute(
                update(m.rollup_queue)
                .where(q.run_id == run_id, q.step == step)
                .values(rolled_n=len(group), rolled_at=max(row["recv_ts"] for row in group))
            )
    # Settled steps leave the queue; a row arriving later queues its step again.
    conn.execute(
        delete(m.rollup_queue).where(q.rolled_at.is_not(None), q.rolled_at < now - SETTLE_S)
    )
    return len(due)


# Metrics a heatmap can show, and the bucket sizes (in steps) kept for them.
HEATMAP_COLUMNS = {
    "step_time": "duration_s",
    "compute": "compute_s",
    "exposed_comm": "exposed_comm_s",
    "data_wait": "data_wait_s",
    "loss": "loss",
}
LEVELS = (16, 256)


def _bucket_maxima(conn: Connection, groups: dict[tuple[int, int], list[Any]]) -> None:
    """Fold rolled-up steps into per-rank bucket maxima. Max is idempotent, so a step
    rolled up again (late rows, replays) changes nothing it should not."""
    best: dict[tuple[int, str, int, int, int], float] = {}
    for (run_id, step), rows in groups.items():
        for metric, column in HEATMAP_COLUMNS.items():
            for row in rows:
                value = row[column]
                if value is None or value != value:  # missing or NaN
                    continue
                for level in LEVELS:
                    key = (run_id, metric, level, step // level, row["rank"])
                    if value > best.get(key, float("-inf")):
                        best[key] = value
    if not best:
        return
    stmt = _insert(conn, m.rank_buckets)
    bigger = (func.max if is_sqlite(conn) else func.greatest)(
        m.rank_buckets.c.max, stmt.excluded.max
    )
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "metric", "level", "bucket", "rank"], set_={"max": bigger}
    )
    rows = [
        {"run_id": k[0], "metric": k[1], "level": k[2], "bucket": k[3], "rank": k[4], "max": v}
        for k, v in best.items()
    ]
    conn.execute(stmt, rows)


def _locked_pass(engine: Engine, *, now: float, grace_s: float, recheck: bool, wait: bool) -> int:
    """One pass in its own transaction, under the advisory lock on PostgreSQL: ``wait``
    for it (flush), or skip the pass when another collector holds it (the loop)."""
    with write(engine) as conn:
        if not is_sqlite(conn):
            lock = "pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock"
            got = conn.execute(text(f"SELECT {lock}(:k)"), {"k": ADVISORY_LOCK_KEY}).scalar()
            if got is False:
                return 0
        return roll_up_ready(conn, now=now, grace_s=grace_s, recheck=recheck)


def flush(engine: Engine, *, now: float, grace_s: float = GRACE_S) -> int:
    """Roll up everything due now (tests and benchmarks use it); waits for the lock."""
    total = 0
    while True:
        done = _locked_pass(engine, now=now, grace_s=grace_s, recheck=True, wait=True)
        total += done
        if done < MAX_STEPS_PER_PASS:
            return total


def rollup_loop(engine: Engine, *, interval_s: float = 0.25, grace_s: float = GRACE_S) -> Loop:
    """The worker's thread inside ``serve``. Steps never rolled up are looked at on every
    pass; rolled-up ones (for late or replayed rows) every ``RECHECK_EVERY`` passes."""
    passes = itertools.count(1)

    def work() -> None:
        while True:
            recheck = next(passes) % RECHECK_EVERY == 0
            done = _locked_pass(
                engine, now=time.time(), grace_s=grace_s, recheck=recheck, wait=False
            )
            if done < MAX_STEPS_PER_PASS:
                return  # else a backlog: keep going

    return Loop("trainwarden-rollup", interval_s, work)
