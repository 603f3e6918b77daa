"""Writing a flush's steps: columns per table, new steps COPYed straight in, a step run
again (a restart, a rollback) replacing the earlier execution and keeping it in
``replaced_steps``, and the steps queued for the rollup worker."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    delete,
    literal,
    select,
    tuple_,
)

from trainwarden.agent.metric_catalog import FIELDS
from trainwarden.collector.ingest.schema_checks import all_finite
from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import copy_rows, dialect_insert, upsert_columns, upsert_rows
from trainwarden.collector.store.db import is_sqlite
from trainwarden.collector.store.partitions import day_of


def take_rows(cols: dict[str, list[Any]], keep: list[int]) -> dict[str, list[Any]]:
    """The rows at ``keep`` of columns ``cols``."""
    return {name: [values[i] for i in keep] for name, values in cols.items()}


def days_of(ts: list[float]) -> list[int]:
    """``day_of`` of each time; one day for all in the usual case."""
    first, last = day_of(min(ts)), day_of(max(ts))
    return [first] * len(ts) if first == last else [day_of(t) for t in ts]


# A stored step row: every wire field of a step that is a rank_steps column of the same
# name, and those the collector adds.
_STEP_COLUMNS = tuple(
    c.name
    for c in m.rank_steps.columns
    if c.name not in ("run_id", "rank", "day", "recv_ts", "issues")
)


STEP_ROW = (
    "run_id",
    "rank",
    "step",
    "day",
    "recv_ts",
    "issues",
    *(c for c in _STEP_COLUMNS if c != "step"),
)


_STEP_KEY = ("run_id", "step", "rank", "day")


_NONFINITE_OK = tuple(f.name for f in FIELDS if f.words)  # stored as NULL, named in ``issues``


def step_columns(run_id: int, steps: dict[str, list[Any]], now: float) -> dict[str, list[Any]]:
    """A request's validated step columns as ``rank_steps`` columns (``STEP_ROW``): a
    column not sent is all NULL; a non-finite loss, grad norm, lr or user metric is stored
    as NULL and named in the row's ``issues`` ("nan", "inf", "-inf")."""
    n = len(steps["step"])
    nulls = [None] * n
    cols = {name: steps.get(name) or nulls for name in _STEP_COLUMNS}
    issues: list[dict[str, str] | None] = list(steps.get("issues") or nulls)
    dirty = False
    for name in _NONFINITE_OK:
        values = cols[name]
        if values is not nulls and not all_finite(values):
            cols[name] = values = list(values)
            for i, value in enumerate(values):
                if value is not None and not math.isfinite(value):
                    issues[i] = {**(issues[i] or {}), name: _nonfinite_word(value)}
                    values[i] = None
                    dirty = True
    user: list[Any] = cols["metrics"]
    if user is not nulls:
        if not all(user):
            user = [d or None for d in user]  # an empty object is no metrics
        try:
            clean = math.isfinite(sum(itertools.chain.from_iterable(d.values() for d in user if d)))
        except TypeError:  # a null among them
            clean = False
        if not clean:
            user = list(user)
            for i, metrics in enumerate(user):
                bad = {
                    k: v
                    for k, v in (metrics or {}).items()
                    if v is not None and not math.isfinite(v)
                }
                if bad:
                    user[i] = {**metrics, **dict.fromkeys(bad)}
                    issues[i] = {
                        **(issues[i] or {}),
                        **{f"user.{k}": _nonfinite_word(v) for k, v in bad.items()},
                    }
                    dirty = True
        cols["metrics"] = user
    if dirty or any(issues):
        issues = [d or None for d in issues]
    cols.update(
        run_id=[run_id] * n,
        rank=steps["rank"],
        day=days_of(steps["ts"]),
        recv_ts=[now] * n,
        issues=issues,
    )
    return {name: cols[name] for name in STEP_ROW}


def _nonfinite_word(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _later_execution(table: Any, new: Any) -> Any:
    """A stored step is replaced only by a later execution of it (a restart or rollback
    ran it again); an exact replay of a batch changes nothing."""
    return table.c.ts < new.ts


def _overwrite_step(table: Any, new: Any) -> dict[str, Any]:
    return {name: new[name] for name in STEP_ROW if name not in _STEP_KEY}


def write_steps(
    conn: Connection, cols: dict[str, list[Any]], high_steps: dict[tuple[int, int], int | None]
) -> dict[str, list[Any]]:
    """Store step rows, given column-wise; return those stored (a stale re-delivery is not)."""
    table, c = m.rank_steps, m.rank_steps.c
    # A step at or before its rank's highest stored step may exist already, under another
    # day too (run again after a rollback or a restart, or an old execution re-delivered
    # late): of all executions of a (run, rank, step) only the latest is kept.
    again = [
        i
        for i, (run_id, rank, step) in enumerate(
            zip(cols["run_id"], cols["rank"], cols["step"], strict=True)
        )
        if (high := high_steps.get((run_id, rank))) is not None and step <= high
    ]
    copied: dict[str, list[Any]] | None = None
    if len(again) < len(cols["step"]):
        # Steps past it are new, but for what the high step cannot know (a rank's row
        # written by a request that committed late, with several collectors): on
        # PostgreSQL the COPY of those rows finds out, and then every row is looked at;
        # SQLite (small runs) looks every time.
        fresh = cols
        if again:
            looked = set(again)
            fresh = take_rows(cols, [i for i in range(len(cols["step"])) if i not in looked])
        if not is_sqlite(conn) and _insert_new(conn, table, fresh):
            if not again:
                return cols
            copied, cols = fresh, take_rows(cols, again)
        again = list(range(len(cols["step"])))
    if again:
        keys = {(cols["run_id"][i], cols["rank"][i], cols["step"][i]): i for i in again}
        listed = list(keys)
        stored = [
            row
            for at in range(0, len(listed), 1000)  # SQLite caps the parameters of a statement
            for row in conn.execute(
                select(c.run_id, c.rank, c.step, c.day, c.ts).where(
                    tuple_(c.run_id, c.rank, c.step).in_(listed[at : at + 1000])
                )
            )
        ]
        stale, older, replaced = set(), [], []
        for run_id, rank, step, day, ts in stored:
            i = keys[(run_id, rank, step)]
            if ts < cols["ts"][i]:  # a later execution: this one is replaced (the upsert's test)
                replaced.append((run_id, rank, step, day))
            if day == cols["day"][i]:
                continue  # same key: the upsert decides
            if ts >= cols["ts"][i]:
                stale.add(i)
            else:
                older.append({"r": run_id, "k": rank, "s": step, "d": day})
        if replaced:
            _keep_replaced(conn, replaced, now=cols["recv_ts"][0])
        if older:
            conn.execute(
                delete(table).where(
                    c.run_id == bindparam("r"),
                    c.rank == bindparam("k"),
                    c.step == bindparam("s"),
                    c.day == bindparam("d"),
                ),
                older,
            )
        if stale:
            cols = take_rows(cols, [i for i in range(len(cols["step"])) if i not in stale])
    upsert_columns(conn, table, cols, key=_STEP_KEY, set_=_overwrite_step, where=_later_execution)
    if copied is not None:
        return {name: copied[name] + values for name, values in cols.items()}
    return cols


REPLACED_COLUMNS = tuple(c.name for c in m.replaced_steps.columns if c.name != "replaced_at")


def _keep_replaced(conn: Connection, keys: list[tuple[int, int, int, int]], *, now: float) -> None:
    """Copy the stored executions that later ones are about to replace into
    ``replaced_steps`` (a rollback's or a restart's steps run again: rare, and never on the
    usual path of new steps)."""
    c = m.rank_steps.c
    for i in range(0, len(keys), 1000):
        chunk = keys[i : i + 1000]
        rows = select(
            *(c[name] for name in REPLACED_COLUMNS), literal(now).label("replaced_at")
        ).where(tuple_(c.run_id, c.rank, c.step, c.day).in_(chunk))
        conn.execute(  # another collector may have kept the same execution just now
            dialect_insert(conn, m.replaced_steps)
            .from_select([*REPLACED_COLUMNS, "replaced_at"], rows)
            .on_conflict_do_nothing()
        )


def _insert_new(conn: Connection, table: Any, cols: dict[str, list[Any]]) -> bool:
    """COPY step rows straight into ``table``, for steps past each rank's last known one
    (the usual flush: new steps only); False, and nothing written, if a row's key is
    there already after all (another collector stored it first), for the upsert to
    decide. Cheaper for PostgreSQL than the staged upsert, which copies every row into
    a temporary table, reads it back, and inserts it speculatively a row (at 16,384
    ranks, rank_steps' statements 15.1 -> 9.4 s over 60 s)."""
    from psycopg import errors

    try:
        with conn.begin_nested():  # a SAVEPOINT: a failed COPY leaves nothing behind
            copy_rows(conn, table, table.name, tuple(cols), zip(*cols.values(), strict=True))
    except (errors.UniqueViolation, errors.DeadlockDetected):
        return False
    return True


def queue_rollups(conn: Connection, counts: Counter[tuple[int, int]], now: float) -> None:
    """Tell the rollup worker about these (run, step)s and how many rows of each this
    flush wrote. A queued step's row is updated in key order (two collectors lock the
    same steps in the same order); one flush at a time per collector."""
    rows = [
        {"run_id": r, "step": s, "first_seen": now, "seen_n": n, "newest": now}
        for (r, s), n in sorted(counts.items())
    ]
    upsert_rows(conn, m.rollup_queue, rows, key=("run_id", "step"), set_=_count_rows)


def _count_rows(table: Any, new: Any) -> dict[str, Any]:
    return {"seen_n": table.c.seen_n + new.seen_n, "newest": new.newest}
