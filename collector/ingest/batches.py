"""Ingest: store one agent batch, keep run and rank state, and queue steps for rollup.

Idempotent: a step replayed after a restart (same run, rank and step) overwrites the
earlier row, and an event whose id was seen before is ignored. A rank that comes
back with a new process session is recorded as a ``restart`` event.
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Integer,
    bindparam,
    case,
    delete,
    func,
    literal,
    null,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from trainwarden.collector.ingest import attempts
from trainwarden.collector.ingest.schemas import (
    AGENT_FIELDS,
    AgentInfo,
    ColumnarBatch,
    EventIn,
    GpuSampleIn,
    IngestBatch,
    IngestResult,
    StepIn,
    all_finite,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import _copy, dialect_insert, upsert_columns, upsert_rows
from trainwarden.collector.store.db import fetch_rows, is_sqlite
from trainwarden.collector.store.partitions import day_of, ensure_partitions

# Run ids never change once a run exists: remember them per database.
_run_ids: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()


def _run_id(conn: Connection, *, name: str, world_size: int, now: float) -> int:
    """The run's id, creating the run on its first batch (two ranks may race: both fine).

    Only an id found already committed is cached: one this transaction inserts could
    still roll back, and a concurrent request must not use it before it commits.
    """
    known = _run_ids.setdefault(conn.engine, {})
    if name in known:
        return known[name]
    query = select(m.runs.c.id).where(m.runs.c.name == name)
    found = conn.execute(query).scalar_one_or_none()
    if found is not None:
        known[name] = int(found)
        return int(found)
    stmt = dialect_insert(conn, m.runs).on_conflict_do_nothing(index_elements=["name"])
    conn.execute(
        stmt, {"name": name, "created_at": now, "updated_at": now, "world_size": world_size}
    )
    return int(conn.execute(query).scalar_one())


def forget_runs(engine: Engine) -> None:
    """Drop the cached run ids: after a failed transaction one may name a run never stored."""
    _run_ids.pop(engine, None)


_HEAD_COLUMNS = (*AGENT_FIELDS, "top", "arrived")  # a flush's headers: and each one's request's


def _newest(heads: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A run's headers in a flush with one row a rank: where a rank sent twice (two
    requests of a node in one flush), its newest header wins, with the highest step of
    both and the later arrival."""
    ranks = heads["rank"]
    if len(set(ranks)) == len(ranks):
        return heads
    last = {rank: i for i, rank in enumerate(ranks)}  # the newest: the later request
    top: dict[int, int] = {}
    for rank, step in zip(ranks, heads["top"], strict=True):
        if step is not None:
            top[rank] = max(step, top.get(rank, step))
    keep = sorted(last.values())
    out = _take(heads, keep)
    out["top"] = [top.get(rank) for rank in out["rank"]]
    return out


def _track_ranks(
    conn: Connection, *, run_id: int, heads: dict[str, list[Any]], now: float
) -> dict[int, int | None]:
    """Heartbeat and progress of the ranks in a flush, in a fixed number of statements
    whatever their number; a rank back with a new process session gets a ``restart``
    event. ``heads``: the ranks' headers column-wise (AgentInfo's fields, one row a
    rank), with ``top`` (each rank's highest step in the flush) and ``arrived`` (when its
    request came in). Returns each known rank's highest step stored before this flush
    (its ``high_step``: ``last_step`` goes back with a rollback, the high step does not)."""
    rk = m.ranks.c
    ranks, sessions, arrived = heads["rank"], heads["session"], heads["arrived"]
    found = fetch_rows(
        conn,
        select(
            rk.rank,
            rk.session,
            rk.last_step,
            rk.last_seen,
            rk.progress_at,
            func.coalesce(rk.high_step, rk.last_step),
        ).where(rk.run_id == run_id, _one_of(conn, rk.rank, ranks)),
    )
    # Rows unpacked as tuples: a Row's attribute access costs, and this runs every flush.
    at = dict(zip(ranks, range(len(ranks)), strict=True))
    previous: dict[int, int | None] = {}
    # A request that arrived before the rank's stored heartbeat is stale: with several
    # collectors, a rank's consecutive requests can commit out of order (one collector
    # behind another). It adds its steps but changes nothing of the rank (the upsert's
    # WHERE), and an old process's late request is no restart.
    restarts: list[tuple[int, str]] = []  # (row in heads, the previous session)
    for rank, session, _, seen, _, high in found:
        previous[rank] = high
        i = at[rank]
        if session != sessions[i] and arrived[i] >= seen:
            restarts.append((i, session))
    if restarts:
        restarts.sort(key=lambda pair: ranks[pair[0]])  # rank order, as the evaluator locks
        back = {ranks[i] for i, _ in restarts}
        attempts.record_lost(
            conn, [dict(zip(_FOUND, row[:5], strict=True)) for row in found if row[0] in back]
        )
        conn.execute(
            dialect_insert(conn, m.events).on_conflict_do_nothing(index_elements=["uid"]),
            [
                {
                    # Derived from both sessions so that a replayed batch cannot add it twice.
                    "uid": uuid.uuid5(uuid.NAMESPACE_OID, f"restart:{before}:{sessions[i]}").hex,
                    "run_id": run_id,
                    "rank": ranks[i],
                    "step": None,
                    "ts": heads["started_at"][i] or now,
                    "recv_ts": now,
                    "kind": "restart",
                    "severity": "warning",
                    "data": {
                        "previous_session": before,
                        "session": sessions[i],
                        "pid": heads["pid"][i],
                    },
                }
                for i, before in restarts
            ],
        )
    n = len(ranks)
    said = heads["last_step"]  # the header's own last step, or its steps here: the higher
    last_steps = [
        t if s is None else (s if t is None else max(s, t))
        for s, t in zip(said, heads["top"], strict=True)
    ]
    node = heads["node"]
    in_step = heads["in_step"]
    sent = heads["sent_at"]
    cols: dict[str, list[Any]] = {
        "run_id": [run_id] * n,
        "rank": ranks,
        "local_rank": heads["local_rank"],
        "host": heads["host"],
        "node": heads["host"]
        if node.count(None) == n
        else [v or h for v, h in zip(node, heads["host"], strict=True)],
        "pid": heads["pid"],
        "session": sessions,
        # Every request is a heartbeat, seen when it arrived (not when the writer got
        # to it: a busy collector must not make its ranks look dead).
        "first_seen": arrived,
        "last_seen": arrived,
        "last_step": last_steps,
        "high_step": last_steps,
        "state": ["healthy"] * n,
        "state_since": [now] * n,
        "heartbeat_s": heads["heartbeat_s"],
        "progress_at": heads["last_step_end"],  # none before the first step: no hung verdict yet
        "in_step": in_step
        if in_step.count(None) == n
        else [None if v is None else int(v) for v in in_step],
        "phase": heads["phase"],
        "clock_skew_s": [None if s is None else t - s for s, t in zip(sent, arrived, strict=True)],
    }
    upsert_columns(
        conn, m.ranks, cols, key=("run_id", "rank"), set_=_rank_update, where=_newer_heartbeat
    )
    return previous


_FOUND = ("rank", "session", "last_step", "last_seen", "progress_at")  # _track_ranks' read


def _one_of(conn: Connection, column: Any, values: list[int]) -> Any:
    """``column IN values``; on PostgreSQL as ``IN (SELECT unnest(array))``: one
    parameter, so the statement is the same whatever the number of values (no per-value
    compile or parse), and a hash semi-join, not ``= ANY(array)``'s linear search of the
    array for each row (12 ms against 3 ms for 600 of 4,096 ranks: ingest ran it on
    every flush)."""
    if is_sqlite(conn):
        return column.in_(values)
    return column.in_(select(func.unnest(bindparam("one_of", values, type_=ARRAY(Integer)))))


def _newer_heartbeat(table: Any, new: Any) -> Any:
    """A rank's row is updated by a request that arrived at or after its stored heartbeat."""
    return table.c.last_seen <= new.last_seen


def _higher(a: Any, b: Any) -> Any:
    """The higher of two values, either of which may be NULL (GREATEST on both databases:
    SQLite's two-argument max() is NULL when either is)."""
    return case((a.is_(None), b), (b.is_(None), a), (a >= b, a), else_=b)


def _rank_update(table: Any, new: Any) -> dict[str, Any]:
    """How a heartbeat updates a known rank: ``new`` is the incoming row (EXCLUDED)."""
    old = table.c
    renewed = old.session != new.session  # a new process: healthy until the evaluator says not
    return {
        # The gap since its last request; none for a new process (its gap is the restart).
        "arrival_gap_s": case((renewed, null()), else_=new.last_seen - old.last_seen),
        **{
            c: new[c]
            for c in (
                "local_rank",
                "host",
                "node",
                "pid",
                "last_seen",
                "heartbeat_s",
                "in_step",
                "phase",
                "clock_skew_s",
                "session",
            )
        },
        "last_step": func.coalesce(new.last_step, old.last_step),
        "high_step": _higher(func.coalesce(old.high_step, old.last_step), new.high_step),
        "progress_at": func.coalesce(new.progress_at, old.progress_at),
        "state": case((renewed, "healthy"), else_=old.state),
        "state_since": case((renewed, new.state_since), else_=old.state_since),
        "state_detail": case((renewed, null()), else_=old.state_detail),
    }


# ---- bulk upserts: binary COPY into a staging table on PostgreSQL, executemany on SQLite


def _take(cols: dict[str, list[Any]], keep: list[int]) -> dict[str, list[Any]]:
    """The rows at ``keep`` of columns ``cols``."""
    return {name: [values[i] for i in keep] for name, values in cols.items()}


def _days(ts: list[float]) -> list[int]:
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
_STEP_ROW = (
    "run_id",
    "rank",
    "step",
    "day",
    "recv_ts",
    "issues",
    *(c for c in _STEP_COLUMNS if c != "step"),
)
_STEP_KEY = ("run_id", "step", "rank", "day")
_NONFINITE_OK = ("loss", "grad_norm")  # stored as NULL, the fact kept in ``issues``


def _step_columns(run_id: int, steps: dict[str, list[Any]], now: float) -> dict[str, list[Any]]:
    """A request's validated step columns as ``rank_steps`` columns (``_STEP_ROW``): a
    column not sent is all NULL; a non-finite loss, grad norm or user metric is stored
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
        day=_days(steps["ts"]),
        recv_ts=[now] * n,
        issues=issues,
    )
    return {name: cols[name] for name in _STEP_ROW}


def _nonfinite_word(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _later_execution(table: Any, new: Any) -> Any:
    """A stored step is replaced only by a later execution of it (a restart or rollback
    ran it again); an exact replay of a batch changes nothing."""
    return table.c.ts < new.ts


def _overwrite_step(table: Any, new: Any) -> dict[str, Any]:
    return {name: new[name] for name in _STEP_ROW if name not in _STEP_KEY}


def _write_steps(
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
            fresh = _take(cols, [i for i in range(len(cols["step"])) if i not in looked])
        if not is_sqlite(conn) and _insert_new(conn, table, fresh):
            if not again:
                return cols
            copied, cols = fresh, _take(cols, again)
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
            cols = _take(cols, [i for i in range(len(cols["step"])) if i not in stale])
    upsert_columns(conn, table, cols, key=_STEP_KEY, set_=_overwrite_step, where=_later_execution)
    if copied is not None:
        return {name: copied[name] + values for name, values in cols.items()}
    return cols


_REPLACED_COLUMNS = (
    "run_id",
    "rank",
    "step",
    "day",
    "ts",
    "duration_s",
    "loss",
    "grad_norm",
    "flags",
    "issues",
)


def _keep_replaced(conn: Connection, keys: list[tuple[int, int, int, int]], *, now: float) -> None:
    """Copy the stored executions that later ones are about to replace into
    ``replaced_steps`` (a rollback's or a restart's steps run again: rare, and never on the
    usual path of new steps)."""
    c = m.rank_steps.c
    for i in range(0, len(keys), 1000):
        chunk = keys[i : i + 1000]
        rows = select(
            *(c[name] for name in _REPLACED_COLUMNS), literal(now).label("replaced_at")
        ).where(tuple_(c.run_id, c.rank, c.step, c.day).in_(chunk))
        conn.execute(  # another collector may have kept the same execution just now
            dialect_insert(conn, m.replaced_steps)
            .from_select([*_REPLACED_COLUMNS, "replaced_at"], rows)
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
            _copy(conn, table, table.name, tuple(cols), zip(*cols.values(), strict=True))
    except (errors.UniqueViolation, errors.DeadlockDetected):
        return False
    return True


def _queue_rollups(conn: Connection, counts: Counter[tuple[int, int]], now: float) -> None:
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


# When this process last wrote each run's row: it is shared by every rank, so it is
# touched at most once a second (and always when a rank says goodbye).
_run_touched: weakref.WeakKeyDictionary[Engine, dict[int, float]] = weakref.WeakKeyDictionary()
RUN_TOUCH_S = 1.0


@dataclass
class _Request:
    """One validated request, in the shape the bulk writer takes."""

    run: str
    world_size: int
    heads: dict[str, list[Any]]  # the ranks' headers, column-wise: AgentInfo's fields
    top: list[int | None]  # each header's rank: its highest step number here (None: none)
    low: list[int | None]  # ... and its lowest
    steps: dict[str, list[Any]]  # step columns: "rank" and StepIn fields, of one length
    agent: AgentInfo | None = None  # one agent's batch: its header (events and GPU samples)
    events: list[EventIn] = field(default_factory=list)
    gpu: list[GpuSampleIn] = field(default_factory=list)


_STEP_FIELDS = tuple(StepIn.model_fields)


def _normalize(batch: IngestBatch | ColumnarBatch) -> _Request:
    if isinstance(batch, IngestBatch):
        a = batch.agent
        dumped = [s.model_dump() for s in batch.steps]
        steps = {
            "rank": [a.rank] * len(dumped),
            **{name: [d[name] for d in dumped] for name in _STEP_FIELDS},
        }
        numbers = steps["step"]
        return _Request(
            batch.run,
            a.world_size,
            {name: [getattr(a, name)] for name in AGENT_FIELDS},
            [max(numbers, default=None)],
            [min(numbers, default=None)],
            steps if dumped else {},
            a,
            batch.events,
            batch.gpu,
        )
    cols, heads = batch.columns(), batch.header_columns()
    if cols.get("rank") == heads["rank"]:  # a row a rank, in the headers' order: the usual
        top = low = cols["step"]
    else:
        by_rank: dict[int, list[int]] = defaultdict(list)
        for rank, step in zip(cols.get("rank", ()), cols.get("step", ()), strict=True):
            by_rank[rank].append(step)
        top = [max(by_rank[r]) if r in by_rank else None for r in heads["rank"]]
        low = [min(by_rank[r]) if r in by_rank else None for r in heads["rank"]]
    return _Request(batch.run, batch.world_size, heads, top, low, cols)


def _requests(batch: IngestBatch | ColumnarBatch) -> list[_Request]:
    """A batch as the writer takes it: one request, and one more for each of a columnar
    batch's ``extras`` (a relay's per-rank events and GPU samples)."""
    if isinstance(batch, IngestBatch) or not batch.extras:
        return [_normalize(batch)]
    return [_normalize(batch), *map(_normalize, batch.extras)]


def batch_rows(batch: IngestBatch | ColumnarBatch) -> int:
    """How many records a validated batch carries (what the writer's bound counts)."""
    if isinstance(batch, IngestBatch):
        return len(batch.steps) + len(batch.events) + len(batch.gpu) + 1
    return (
        len(batch.steps.get("rank", ()))
        + len(batch.header_columns()["rank"])
        + sum(map(batch_rows, batch.extras))
    )


def store_many(
    conn: Connection,
    batches: list[IngestBatch | ColumnarBatch],
    *,
    now: float | None = None,
    arrived: list[float] | None = None,
) -> list[IngestResult]:
    """Store several requests' batches in the caller's transaction, with a fixed number
    of statements per table whatever their number (the collector's group commit).
    ``arrived``: when each request reached the collector (default: ``now``)."""
    now = time.time() if now is None else now
    requests: list[_Request] = []
    owner: list[int] = []  # each request's batch
    for i, batch in enumerate(batches):
        got = _requests(batch)
        requests += got
        owner += [i] * len(got)
    when = [arrived[i] for i in owner] if arrived else [now] * len(requests)
    # First, before this transaction locks anything: a day partition a row needs.
    days = {day for req in requests if req.steps for day in _days(req.steps["ts"])}
    days |= {day_of(g.ts) for req in requests for g in req.gpu}
    ensure_partitions(conn.engine, days)
    run_ids = {}
    for req in sorted(requests, key=lambda r: r.run):
        if req.run not in run_ids:
            run_ids[req.run] = _run_id(conn, name=req.run, world_size=req.world_size, now=now)

    # Ranks: each run's headers column-wise (a list a field, not an object a rank).
    by_run: dict[int, dict[str, list[Any]]] = {}
    for req, at in zip(requests, when, strict=True):
        heads = by_run.get(run_ids[req.run])
        if heads is None:
            heads = by_run[run_ids[req.run]] = {name: [] for name in _HEAD_COLUMNS}
        for name in AGENT_FIELDS:
            heads[name] += req.heads[name]
        heads["top"] += req.top
        heads["arrived"] += [at] * len(req.top)
    high_steps: dict[tuple[int, int], int | None] = {}
    for run_id in sorted(by_run):
        known = _track_ranks(conn, run_id=run_id, heads=_newest(by_run[run_id]), now=now)
        high_steps.update({(run_id, rank): high for rank, high in known.items()})

    # Steps, column-wise (no object a row): the same step twice in one flush (a replay
    # inside it, or a rollback's second execution queued behind its first): the later
    # execution wins, and an earlier one is kept as replaced.
    merged: dict[str, list[Any]] = {name: [] for name in _STEP_ROW}
    accepted_steps = []
    for req in requests:
        if not req.steps:
            accepted_steps.append(0)
            continue
        accepted_steps.append(len(set(zip(req.steps["rank"], req.steps["step"], strict=True))))
        for name, values in _step_columns(run_ids[req.run], req.steps, now).items():
            merged[name] += values
    keys = list(zip(merged["run_id"], merged["rank"], merged["step"], strict=True))
    if len(set(keys)) < len(keys):
        latest: dict[tuple[int, int, int], int] = {}
        for i, key in enumerate(keys):
            if key not in latest or merged["ts"][i] >= merged["ts"][latest[key]]:
                latest[key] = i
        keep = sorted(latest.values())
        kept = set(keep)
        # Each earlier execution once, however often it was sent (a retried batch).
        earlier = list(
            {
                (keys[i], merged["ts"][i]): i
                for i in range(len(keys))
                if i not in kept and merged["ts"][i] < merged["ts"][latest[keys[i]]]
            }.values()
        )
        if earlier:
            conn.execute(
                dialect_insert(conn, m.replaced_steps).on_conflict_do_nothing(),
                [
                    {**{name: merged[name][i] for name in _REPLACED_COLUMNS}, "replaced_at": now}
                    for i in earlier
                ],
            )
        merged = _take(merged, keep)
    stored = _write_steps(conn, merged, high_steps)
    _queue_rollups(conn, Counter(zip(stored["run_id"], stored["step"], strict=True)), now)

    accepted_events = _store_events(conn, requests, run_ids, now)
    firsts: dict[str, tuple[int, float]] = {}
    done = attempts.sessions_started(conn.engine)
    for req in requests:
        if not done.issuperset(req.heads["session"]):  # a process's first steps: rare
            for rank, session, first in zip(
                req.heads["rank"], req.heads["session"], req.low, strict=True
            ):
                if first is not None and session not in done and session not in firsts:
                    firsts[session] = (first, _started_at(req, rank, first))
    attempts.record_first_steps(conn, firsts)
    _store_gpu(conn, requests, run_ids, now)
    for req in requests:  # a rank saying goodbye ends the run when it is the last
        if any(e.kind == "shutdown" for e in req.events):
            _update_run(
                conn,
                run_id=run_ids[req.run],
                world_size=req.world_size,
                last=None,
                shutdown=True,
                now=now,
            )
    for run, run_id in sorted(run_ids.items()):
        req_last = [max(req.steps["step"]) for req in requests if req.run == run and req.steps]
        world = max(req.world_size for req in requests if req.run == run)
        _update_run(
            conn,
            run_id=run_id,
            world_size=world,
            last=max(req_last, default=None),
            shutdown=False,
            now=now,
        )
    if len(requests) == len(batches):
        return [
            IngestResult(accepted_steps=n, accepted_events=e)
            for n, e in zip(accepted_steps, accepted_events, strict=True)
        ]
    totals = [[0, 0] for _ in batches]
    for i, n, e in zip(owner, accepted_steps, accepted_events, strict=True):
        totals[i][0] += n
        totals[i][1] += e
    return [IngestResult(accepted_steps=n, accepted_events=e) for n, e in totals]


def _started_at(req: _Request, rank: int, step: int) -> float:
    """When ``rank`` started ``step`` in this request (its first step: a rare lookup)."""
    cols = req.steps
    return next(
        ts
        for r, s, ts in zip(cols["rank"], cols["step"], cols["ts"], strict=True)
        if r == rank and s == step
    )


def _store_events(
    conn: Connection, requests: list[_Request], run_ids: dict[str, int], now: float
) -> list[int]:
    """Insert every request's events; a replayed event id is ignored and not counted."""
    rows = []
    for req in requests:
        rank = req.agent.rank if req.agent is not None else None
        rows += [
            {
                "uid": e.id,
                "run_id": run_ids[req.run],
                "rank": rank,
                "step": e.step,
                "ts": e.ts,
                "recv_ts": now,
                "kind": e.kind,
                "severity": e.severity,
                "data": e.data,
            }
            for e in req.events
        ]
    if not rows:
        return [0] * len(requests)
    fresh = set(
        conn.execute(
            dialect_insert(conn, m.events)
            .on_conflict_do_nothing(index_elements=["uid"])
            .returning(m.events.c.uid),
            sorted({row["uid"]: row for row in rows}.values(), key=lambda row: str(row["uid"])),
        ).scalars()
    )
    counts = []
    fresh_ids = set(fresh)
    for req in requests:
        counts.append(sum(1 for e in req.events if e.id in fresh))
        fresh -= {e.id for e in req.events}  # the same id twice in one flush counts once
        if req.agent is None:  # a node's columns: steps only
            continue
        run_id, agent = run_ids[req.run], req.agent
        where = (m.ranks.c.run_id == run_id) & (m.ranks.c.rank == agent.rank)
        for e in req.events:
            if e.kind == "attempt_start" and e.id in fresh_ids:
                attempts.record_start(conn, run_id, agent, e, now)
            elif e.kind == "attempt_end" and e.id in fresh_ids:
                attempts.record_end(conn, agent, e)
            if e.kind == "gpu_telemetry":  # "ok" with the device, or "unavailable" and why
                conn.execute(update(m.ranks).where(where).values(gpu=e.data))
            elif e.kind == "shutdown":  # failed: the process ended on an exception in a step
                failed = bool(e.data.get("error"))
                conn.execute(
                    update(m.ranks)
                    .where(where)
                    .values(
                        state="failed" if failed else "finished",
                        state_since=now,
                        state_detail={"reason": e.data["error"]} if failed else None,
                    )
                )
    return counts


def _store_gpu(
    conn: Connection, requests: list[_Request], run_ids: dict[str, int], now: float
) -> None:
    rows = []
    for req in requests:
        if not req.gpu or req.agent is None:
            continue
        run_id, rank = run_ids[req.run], req.agent.rank
        rows += [
            {
                **g.model_dump(),
                "run_id": run_id,
                "rank": rank,
                "day": day_of(g.ts),
                "recv_ts": now,
                "remap_pending": None if g.remap_pending is None else int(g.remap_pending),
                "simulated": int(g.simulated),
            }
            for g in req.gpu
        ]
        latest = max(req.gpu, key=lambda g: g.ts)
        conn.execute(
            update(m.ranks)
            .where(m.ranks.c.run_id == run_id, m.ranks.c.rank == rank)
            .values(
                gpu={
                    "uuid": latest.gpu_uuid,
                    "name": latest.gpu_name,
                    "simulated": latest.simulated,
                }
            )
        )
    if rows:
        rows = list({(r["run_id"], r["rank"], r["ts"]): r for r in rows}.values())
        upsert_rows(conn, m.gpu_samples, rows, key=("run_id", "rank", "ts", "day"))


def _update_run(
    conn: Connection, *, run_id: int, world_size: int, last: int | None, shutdown: bool, now: float
) -> None:
    """Last: this row is shared by every rank of the run, so hold its lock briefly."""
    touched = _run_touched.setdefault(conn.engine, {})
    if not shutdown and now - touched.get(run_id, 0.0) < RUN_TOUCH_S:
        return
    touched[run_id] = now
    values: dict[str, Any] = {"updated_at": now, "world_size": world_size}
    if last is not None:
        r = m.runs.c
        values["last_step"] = case(
            (or_(r.last_step.is_(None), r.last_step < last), last), else_=r.last_step
        )
    if not shutdown:
        conn.execute(update(m.runs).where(m.runs.c.id == run_id).values(status="running", **values))
        return
    # A rank said goodbye: count how the ranks ended (rare, so a scan is fine).
    counts = conn.execute(
        select(
            func.count(),
            func.sum(case((m.ranks.c.state.in_(("finished", "failed")), 1), else_=0)),
            func.sum(case((m.ranks.c.state == "failed", 1), else_=0)),
        ).where(m.ranks.c.run_id == run_id)
    ).one()
    seen, ended, failed = counts[0], counts[1] or 0, counts[2] or 0
    status = "running"
    if seen >= world_size and ended == seen:  # every rank said goodbye
        status = "failed" if failed else "finished"
    conn.execute(update(m.runs).where(m.runs.c.id == run_id).values(status=status, **values))


def ingest(conn: Connection, *, batch: IngestBatch, now: float | None = None) -> IngestResult:
    """Store one agent's batch in the caller's transaction."""
    return store_many(conn, [batch], now=now)[0]


def ingest_columns(
    conn: Connection, *, batch: ColumnarBatch, now: float | None = None
) -> IngestResult:
    """Store several ranks' steps (a node's, say) in the caller's transaction."""
    return store_many(conn, [batch], now=now)[0]
