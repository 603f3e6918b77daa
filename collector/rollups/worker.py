"""Roll steps up across ranks once, when they are complete, not on every rank's batch.

Ingest queues each (run, step) it writes in ``rollup_queue`` (insert-if-absent: no
row lock, so a step's ranks never wait on each other). The worker rolls a queued step
up when every rank of the run has reported it, or when no row of it has arrived for
``grace_s`` (late or dead ranks), and records how many rows it saw and the newest
receive time. A late or replayed row changes one of those, and the step is
rolled up again. Steps leave the queue ``SETTLE_S`` after their last rollup.

One worker runs at a time: on PostgreSQL it takes an advisory lock, so any number of
collectors can run against one database without double work.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import defaultdict
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Engine,
    and_,
    bindparam,
    delete,
    func,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from trainwarden.agent import metric_catalog as catalog
from trainwarden.collector.loops import Loop
from trainwarden.collector.rollups.aggregate import (
    USER_CHUNK,
    USER_KEYS_SQL,
    aggregate,
    aggregate_sql,
    aggregate_user_sql,
    stats_from_sql,
    user_stats_from_sql,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import upsert
from trainwarden.collector.store.db import is_sqlite, write
from trainwarden.collector.store.partitions import ensure_ahead

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_726F_6C6C  # "twroll"
GRACE_S = 5.0
SETTLE_S = 30.0  # a rolled-up step stays queued this long, to catch late and replayed rows
RECHECK_EVERY = 8  # passes between looks at already rolled-up steps (late rows, replays)
MAX_STEPS_PER_PASS = 2_000


def due_query(recheck: bool) -> Any:
    """The queued steps a pass looks at, with their rank count and newest receive time
    (``n``, ``newest``), oldest first, at most ``MAX_STEPS_PER_PASS``."""
    q, s, r = m.rollup_queue.c, m.rank_steps.c, m.runs.c
    if not recheck:  # the cheap pass: steps never rolled up, by what ingest counted as it wrote
        return (
            select(
                q.run_id,
                q.step,
                q.first_seen,
                q.rolled_n,
                q.rolled_at,
                r.world_size,
                q.seen_n.label("n"),
                func.coalesce(q.newest, q.first_seen).label("newest"),
            )
            .join(m.runs, r.id == q.run_id)
            .where(q.rolled_n.is_(None))
            .order_by(q.first_seen)
            .limit(MAX_STEPS_PER_PASS)
        )
    # Count the rows themselves (late rows, replays, another collector's) of the steps
    # some ingest wrote to since their rollup: every write adds to seen_n, in the
    # database (so another collector's too), and the rollup records the rows it saw; a
    # quiet step has the two equal and is not counted again (at 4,096 ranks, recounting
    # 30 s of queued steps was a tenth of PostgreSQL's time).
    # Counted by subqueries on each queued step's key (the primary key's prefix): as a
    # join, PostgreSQL hashed the whole day's partition of rank_steps against the queue
    # (at 16,384 ranks, 0.8 s a call after 4 minutes, 2 s at most, and growing with the
    # day; the soak's steady decline in rows/s).
    mine = and_(s.run_id == q.run_id, s.step == q.step)
    return (
        select(
            q.run_id,
            q.step,
            q.first_seen,
            q.rolled_n,
            q.rolled_at,
            r.world_size,
            select(func.count()).where(mine).scalar_subquery().label("n"),
            select(func.max(s.recv_ts)).where(mine).scalar_subquery().label("newest"),
        )
        .join(m.runs, r.id == q.run_id)
        .where(or_(q.rolled_n.is_(None), q.seen_n != q.rolled_n))
        .order_by(q.first_seen)
        .limit(MAX_STEPS_PER_PASS)
    )


def roll_up_ready(
    conn: Connection,
    *,
    now: float,
    grace_s: float = GRACE_S,
    recheck: bool = True,
    buckets: list[tuple[int, int]] | None = None,
) -> int:
    """Roll up every queued step that is due: complete (or past its grace) and not yet
    rolled, or (``recheck``) rolled before a late or replayed row arrived. Returns how many.
    ``buckets``: the rolled-up (run, step)s are added to it, for the caller to write their
    heatmap buckets' maxima after this transaction (:func:`_bucket_maxima`); by default
    they are written here."""
    q = m.rollup_queue.c
    counts = due_query(recheck)
    # An incomplete step waits until its rows stop coming, not a fixed time after its
    # first: when ingest runs behind, its ranks' rows are still being written, and a
    # step rolled up early is rolled up again for each late batch (with its heatmap
    # bucket): work that grows as the collector falls behind.
    due = [
        row
        for row in conn.execute(counts)
        if row.n  # none: queued, but its rows are gone (a pruned day)
        and (
            (row.rolled_n is None and (row.n >= row.world_size or now - row.newest >= grace_s))
            or (row.rolled_n is not None and (row.n != row.rolled_n or row.newest > row.rolled_at))
        )
    ]
    if not recheck:
        due = _really_complete(conn, due, now=now, grace_s=grace_s)
    if due:
        keys = [(row.run_id, row.step) for row in due]
        stats, seen = (_aggregate_here if is_sqlite(conn) else _aggregate_in_db)(conn, keys)
        upsert(conn, m.step_stats, stats, key=["run_id", "metric", "step"])
        if buckets is None:
            _bucket_maxima(conn, list(seen))
        else:
            buckets += seen
        conn.execute(
            update(m.rollup_queue)
            .where(q.run_id == bindparam("r"), q.step == bindparam("s"))
            .values(rolled_n=bindparam("n"), rolled_at=bindparam("at")),
            [{"r": r, "s": st, "n": n, "at": at} for (r, st), (n, at) in sorted(seen.items())],
        )
    # Settled steps leave the queue; a row arriving later queues its step again.
    conn.execute(
        delete(m.rollup_queue).where(q.rolled_at.is_not(None), q.rolled_at < now - SETTLE_S)
    )
    return len(due)


def _really_complete(conn: Connection, due: list[Any], *, now: float, grace_s: float) -> list[Any]:
    """``due`` less the steps ingest's count calls complete that are not: a replayed
    batch is counted again. Only those steps' rows are counted (about one a pass)."""
    claimed = {(row.run_id, row.step): row.world_size for row in due if now - row.newest < grace_s}
    if not claimed:
        return due
    s = m.rank_steps.c
    found = conn.execute(
        select(s.run_id, s.step, func.count())
        .where(tuple_(s.run_id, s.step).in_(list(claimed)))
        .group_by(s.run_id, s.step)
    ).all()
    short = {(run_id, step) for run_id, step, n in found if n < claimed[(run_id, step)]}
    return [row for row in due if (row.run_id, row.step) not in short]


Rolled = dict[tuple[int, int], tuple[int, float]]  # (run, step): (rows, newest receive time)


def _aggregate_here(
    conn: Connection, keys: list[tuple[int, int]]
) -> tuple[list[dict[str, Any]], Rolled]:
    """Roll up in Python (SQLite: no percentiles in SQL)."""
    s = m.rank_steps.c
    rows = conn.execute(select(m.rank_steps).where(tuple_(s.run_id, s.step).in_(keys))).mappings()
    groups: dict[tuple[int, int], list[Any]] = defaultdict(list)
    for row in rows:
        groups[(row["run_id"], row["step"])].append(row)
    stats = [
        stat for (run_id, step), group in groups.items() for stat in aggregate(run_id, step, group)
    ]
    seen = {
        key: (len(group), max(row["recv_ts"] for row in group)) for key, group in groups.items()
    }
    return stats, seen


_AGGREGATE_SQL = text(aggregate_sql()).bindparams(bindparam("steps", type_=ARRAY(BigInteger)))
_USER_KEYS_SQL = text(USER_KEYS_SQL).bindparams(bindparam("steps", type_=ARRAY(BigInteger)))


@functools.lru_cache(maxsize=USER_CHUNK)
def _user_sql(n: int) -> Any:
    return text(aggregate_user_sql(n)).bindparams(bindparam("steps", type_=ARRAY(BigInteger)))


def _aggregate_in_db(
    conn: Connection, keys: list[tuple[int, int]]
) -> tuple[list[dict[str, Any]], Rolled]:
    """Roll up in PostgreSQL: one GROUP BY per run, next to the data."""
    by_run: dict[int, list[int]] = defaultdict(list)
    for run_id, step in keys:
        by_run[run_id].append(step)
    stats: list[dict[str, Any]] = []
    seen: Rolled = {}
    for run_id, steps in by_run.items():
        ts = {}  # steps with user metrics: their time
        for row in conn.execute(_AGGREGATE_SQL, {"run": run_id, "steps": steps}).mappings():
            stats += stats_from_sql(run_id, row)
            seen[(run_id, row["step"])] = (row["rows_n"], row["newest"])
            if row["user_n"]:
                ts[row["step"]] = row["ts"]
        if ts:  # a second pass over the rows, only where a rank sent user metrics
            params: dict[str, Any] = {"run": run_id, "steps": list(ts)}
            names = sorted(conn.execute(_USER_KEYS_SQL, params).scalars())
            for at in range(0, len(names), USER_CHUNK):
                chunk = names[at : at + USER_CHUNK]
                bound = {**params, **{f"k{i}": name for i, name in enumerate(chunk)}}
                for row in conn.execute(_user_sql(len(chunk)), bound).mappings():
                    stats += user_stats_from_sql(run_id, row, chunk, ts[row["step"]])
    return stats, seen


# Metrics a heatmap can show, and the bucket sizes (in steps) kept for them.
HEATMAP_COLUMNS = {m.name: str(m.field) for m in catalog.METRICS if m.heatmap}
LEVELS = (16, 64, 256)


def _bucket_maxima(conn: Connection, groups: list[tuple[int, int]]) -> None:
    """Per-rank maxima of whole step buckets, written in SQL when a bucket closes: a
    bucket of 16 steps closes when a later step is rolled up (or its last step is),
    one of 64 (256) when its last 16-step (64-step) bucket closes. A step rolled up
    again (late rows, replays) recomputes its closed buckets; max is idempotent. The
    open bucket at a run's edge is read from raw rows by the heatmap query."""
    steps: dict[int, set[int]] = defaultdict(set)
    for run_id, step in groups:
        steps[run_id].add(step)
    small = LEVELS[0]
    for run_id, rolled in steps.items():
        closed = _last_bucket(conn, run_id, small)
        top = max(rolled)
        newest = top // small if top % small == small - 1 else top // small - 1
        todo = {s // small for s in rolled if closed is not None and s // small <= closed}
        first_open = 0 if closed is None else closed + 1
        if newest >= first_open:  # every bucket up to the newest closed, even ones skipped
            todo |= set(range(first_open, newest + 1))
        if not todo:
            continue
        for lo, hi in _spans(sorted(todo)):
            conn.execute(
                _FROM_RAW[_dialect(conn)],
                {"run": run_id, "lo": lo * small, "hi": hi * small + small - 1},
            )
        closed = max(todo | {closed if closed is not None else -1})
        # Each level from the one below: what changed there, and what closed.
        for child, parent in itertools.pairwise(LEVELS):
            per = parent // child
            up = _last_bucket(conn, run_id, parent)
            newest_up = closed // per if closed % per == per - 1 else closed // per - 1
            todo = {b // per for b in todo if up is not None and b // per <= up}
            first_open = 0 if up is None else up + 1
            if newest_up >= first_open:
                todo |= set(range(first_open, newest_up + 1))
            if not todo:
                break  # nothing changed at this level: nothing above it either
            for lo, hi in _spans(sorted(todo)):
                conn.execute(
                    _FROM_CHILD[_dialect(conn), child],
                    {"run": run_id, "lo": lo * per, "hi": hi * per + per - 1},
                )
            closed = max(todo | {up if up is not None else -1})


def _last_bucket(conn: Connection, run_id: int, level: int) -> int | None:
    """The newest closed bucket of this level (buckets close in order)."""
    k = m.bucket_maxima.c
    return conn.execute(
        select(func.max(k.bucket)).where(
            k.run_id == run_id, k.metric == "step_time", k.level == level
        )
    ).scalar()


def _spans(values: list[int]) -> list[tuple[int, int]]:
    """Sorted integers as (first, last) runs of consecutive values."""
    spans: list[tuple[int, int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], v)
        else:
            spans.append((v, v))
    return spans


def _dialect(conn: Connection) -> str:
    return "sqlite" if is_sqlite(conn) else "postgresql"


def _upsert_buckets(per_rank_sql: str, dialect: str) -> Any:
    """Store the buckets of ``per_rank_sql``'s rows (run_id, metric, level, bucket, rank,
    max: one a rank and bucket) as one row a bucket, its ranks and their maxima in rank
    order; a bucket stored before is replaced (its maxima taken again from all its rows)."""
    if dialect == "postgresql":
        grouped = (
            "SELECT run_id, metric, level, bucket, array_agg(rank ORDER BY rank), "
            f"array_agg(max ORDER BY rank) FROM ({per_rank_sql}) AS b "
            "GROUP BY run_id, metric, level, bucket"
        )
    else:  # json_group_array takes the rows in the order the subquery gives them; a
        # maximum as 17 digits (SQLite writes a REAL in JSON with 15: not the same double)
        grouped = (
            "SELECT run_id, metric, level, bucket, json_group_array(rank), "
            "json_group_array(json(printf('%!.17g', max))) "
            f"FROM (SELECT * FROM ({per_rank_sql}) ORDER BY run_id, metric, level, bucket, rank) "
            "GROUP BY run_id, metric, level, bucket"
        )
    # `WHERE true` and the subquery: SQLite's parser needs them before ON CONFLICT.
    return text(
        "INSERT INTO bucket_maxima (run_id, metric, level, bucket, ranks, maxima) "
        f"SELECT * FROM ({grouped}) AS g WHERE true "
        "ON CONFLICT (run_id, metric, level, bucket) "
        "DO UPDATE SET ranks = excluded.ranks, maxima = excluded.maxima"
    )


def _from_child_sql(child: int, parent: int, dialect: str) -> str:
    """Each rank's maxima of a level's buckets, from the closed buckets of the level below."""
    per = parent // child
    if dialect == "postgresql":
        each = "CROSS JOIN LATERAL unnest(c.ranks, c.maxima) AS u(rank, max)"
        rank, value = "u.rank", "u.max"
    else:
        each = "JOIN json_each(c.ranks) AS r JOIN json_each(c.maxima) AS x ON x.key = r.key"
        rank, value = "r.value", "x.value"
    return (
        f"SELECT c.run_id, c.metric, {parent} AS level, c.bucket / {per} AS bucket, "
        f"{rank} AS rank, max({value}) AS max FROM bucket_maxima AS c {each} "
        f"WHERE c.run_id = :run AND c.level = {child} AND c.bucket BETWEEN :lo AND :hi "
        f"GROUP BY c.run_id, c.metric, c.bucket / {per}, {rank}"
    )


def _from_raw_sql() -> str:
    """Each rank's maxima of every heatmap metric in one GROUP BY over the buckets' rows,
    then a row per metric (a cross join with the metric names; none where all are NULL).
    As five GROUP BYs over the same rows, one a metric, it took 1.5-1.7 s for a 16-step
    bucket of 16,384 ranks; this way 0.3 s (the same 81,920 rows)."""
    small = LEVELS[0]
    maxima = ", ".join(
        f"max({column}) AS m{i}" for i, column in enumerate(HEATMAP_COLUMNS.values())
    )
    pick = " ".join(f"WHEN '{metric}' THEN t.m{i}" for i, metric in enumerate(HEATMAP_COLUMNS))
    names = " UNION ALL ".join(f"SELECT '{metric}' AS metric" for metric in HEATMAP_COLUMNS)
    return (
        "SELECT run_id, metric, level, bucket, rank, max FROM ("
        f"SELECT t.run_id, k.metric, {small} AS level, t.bucket, t.rank, CASE k.metric "
        f"{pick} END AS max "
        f"FROM (SELECT run_id, step / {small} AS bucket, rank, {maxima} FROM rank_steps "
        f"WHERE run_id = :run AND step BETWEEN :lo AND :hi GROUP BY run_id, step / {small}, "
        "rank) AS t "
        f"CROSS JOIN ({names}) AS k) AS c WHERE max IS NOT NULL"
    )


_DIALECTS = ("postgresql", "sqlite")
_FROM_RAW = {dialect: _upsert_buckets(_from_raw_sql(), dialect) for dialect in _DIALECTS}
_FROM_CHILD = {  # a level's buckets from the closed buckets of the level below
    (dialect, child): _upsert_buckets(_from_child_sql(child, parent, dialect), dialect)
    for dialect in _DIALECTS
    for child, parent in itertools.pairwise(LEVELS)
}


def _locked(conn: Connection, *, wait: bool) -> bool:
    """The rollup's advisory lock, to the end of this transaction (PostgreSQL): ``wait``
    for it, or False at once when another collector holds it."""
    if is_sqlite(conn):
        return True
    lock = "pg_advisory_xact_lock" if wait else "pg_try_advisory_xact_lock"
    return conn.execute(text(f"SELECT {lock}(:k)"), {"k": ADVISORY_LOCK_KEY}).scalar() is not False


def _locked_pass(engine: Engine, *, now: float, grace_s: float, recheck: bool, wait: bool) -> int:
    """One pass under the advisory lock: ``wait`` for it (flush), or skip the pass when
    another collector holds it (the loop). The steps' rollups are committed first, and
    their heatmap buckets' maxima written after, in a transaction of their own: a bucket
    of 16 steps at 16,384 ranks takes a second, and the steps waiting on it would not
    be queryable until it was done (the tail of ingest -> queryable). The second waits
    for the lock (another collector's pass is short). A crash between the two loses a
    re-rolled bucket's update; a newly closed bucket is written with the next step."""
    buckets: list[tuple[int, int]] = []
    with write(engine) as conn:
        if not _locked(conn, wait=wait):
            return 0
        done = roll_up_ready(conn, now=now, grace_s=grace_s, recheck=recheck, buckets=buckets)
    if buckets:
        with write(engine) as conn:
            _locked(conn, wait=True)
            _bucket_maxima(conn, buckets)
    return done


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
        # Today's and tomorrow's day partitions, so ingest seldom creates one itself
        # (a no-op once this process has made them; a new day brings the next).
        ensure_ahead(engine)
        while True:
            recheck = next(passes) % RECHECK_EVERY == 0
            done = _locked_pass(
                engine, now=time.time(), grace_s=grace_s, recheck=recheck, wait=False
            )
            if done < MAX_STEPS_PER_PASS:
                return  # else a backlog: keep going

    return Loop("trainwarden-rollup", interval_s, work)
