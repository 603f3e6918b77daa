"""Series for charts: a metric per step across ranks (downsampled on the server, spikes
kept), one rank's own, the rank x step heatmap, and the executions a rollback or restart
replaced."""

from __future__ import annotations

from functools import partial
from typing import Any

from sqlalchemy import Connection, Float, Integer, and_, case, cast, func, or_, select
from sqlalchemy.dialects.postgresql import array

from trainwarden.agent import metric_catalog as catalog
from trainwarden.alerts.metrics import METRICS
from trainwarden.collector.ingest import user_metrics
from trainwarden.collector.read import user_metrics as user_metric_reads
from trainwarden.collector.read.queries import UnknownMetric, run_id_of
from trainwarden.collector.read.schemas import (
    Heatmap,
    RankSeries,
    ReplacedSeries,
    Series,
)
from trainwarden.collector.rollups.worker import HEATMAP_COLUMNS, LEVELS
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import fetch_rows, is_sqlite


def series(
    conn: Connection,
    *,
    run: str,
    metric: str,
    from_step: int | None = None,
    to_step: int | None = None,
    last: int | None = None,
    points: int | None = None,
) -> Series:
    """Per-step min / median / max / total of ``metric`` across ranks, oldest step first.

    ``last`` keeps only the newest N steps (after the from/to filter). ``points``
    downsamples to at most N points so that spikes survive: each point is a bucket of
    ``bucket`` consecutive steps (from the first step read) and holds its min of mins,
    max of maxes and of p99s, mean of medians and, for ``total``, the bucket's most
    extreme value (a spike or a dip, whichever is further from the bucket's mean).
    """
    run_id = run_id_of(conn, run)
    if metric not in METRICS and not user_metric_reads.has(conn, run_id=run_id, metric=metric):
        raise UnknownMetric(metric, user_metric_reads.names(conn, run_id=run_id))
    s = m.step_stats.c
    query = select(s.step, s.ts, s.n, s.min, s.median, s.max, s.total, s.argmax_rank, s.p99).where(
        s.run_id == run_id, s.metric == metric
    )
    if from_step is not None:
        query = query.where(s.step >= from_step)
    if to_step is not None:
        query = query.where(s.step <= to_step)
    if last is not None:
        query = query.order_by(s.step.desc()).limit(last)
    bucket = 1
    if points is not None and not is_sqlite(conn):
        rows, bucket = _squeezed(conn, query, points=points)
    else:
        rows = sorted(conn.execute(query).all(), key=lambda r: r[0])
        if points is not None and len(rows) > points:
            bucket = _bucket_size(rows[0][0], rows[-1][0], points)
            rows = _squeeze_all(rows, bucket)
    columns: list[Any] = list(zip(*rows, strict=False)) if rows else [[] for _ in range(9)]
    return Series(
        bucket=bucket,
        run=run,
        metric=metric,
        unit=METRICS[metric].unit if metric in METRICS else "",  # a user metric has none
        step=list(columns[0]),
        ts=list(columns[1]),
        n=list(columns[2]),
        min=list(columns[3]),
        median=list(columns[4]),
        max=list(columns[5]),
        total=list(columns[6]),
        argmax_rank=list(columns[7]),
        p99=list(columns[8]),
    )


def _bucket_size(first: int, last: int, points: int) -> int:
    """Steps a point so that ``first`` .. ``last`` make at most ``points`` points."""
    return max(1, -(-(last - first + 1) // points))


def _squeezed(conn: Connection, query: Any, *, points: int) -> tuple[list[Any], int]:
    """:func:`_squeeze_all` in PostgreSQL: the rows of ``query`` (step, ts, n, min, median,
    max, total, argmax_rank, p99), downsampled to at most ``points``, and the bucket size.
    A run of a thousand ranks has 10,000 steps a metric: fetching and squeezing them in
    Python took 20 ms a series, holding the GIL the page's other callbacks want. One
    aggregate over the rows, each value picked with an array's order (no window, no sort
    within a bucket): 15 ms for 10,000 steps, against 62 ms numbering the rows first
    (EXPLAIN ANALYZE, 2 vCPU)."""
    q = query.subquery()
    first, last, n = conn.execute(
        select(func.min(q.c.step), func.max(q.c.step), func.count())
    ).one()
    if not n:
        return [], 1
    size = 1 if n <= points else _bucket_size(first, last, points)
    step = cast(q.c.step, Float)
    b = ((q.c.step - first) // size).label("b")
    # The first value by step, or the greatest (max) / least (min) with the earliest step
    # on a tie: arrays compare element by element.
    g = (
        select(
            b,
            func.min(q.c.step).label("step"),
            func.min(array([step, q.c.ts]))[2].label("ts"),
            func.max(q.c.n).label("n"),
            func.min(q.c.min).label("min"),
            func.avg(q.c.median).label("median"),
            func.max(q.c.max).label("max"),
            func.avg(q.c.total).label("mean"),
            func.max(array([q.c.total, -step])).filter(q.c.total.isnot(None)).label("hi"),
            func.min(array([q.c.total, step])).filter(q.c.total.isnot(None)).label("lo"),
            func.coalesce(
                func.max(array([q.c.max, -step, cast(q.c.argmax_rank, Float)])).filter(
                    q.c.max.isnot(None)
                )[3],
                func.min(array([step, cast(q.c.argmax_rank, Float)]))[2],
            ).label("top"),
            func.max(q.c.p99).label("p99"),
        )
        .group_by(b)
        .subquery()
    )
    c = g.c
    up, down = c.hi[1] - c.mean, c.mean - c.lo[1]
    total = case((or_(up > down, and_(up == down, -c.hi[2] < c.lo[2])), c.hi[1]), else_=c.lo[1])
    rows = conn.execute(
        select(
            c.step, c.ts, c.n, c.min, c.median, c.max, total, cast(c.top, Integer), c.p99
        ).order_by(c.b)
    ).all()
    return [tuple(r) for r in rows], size


def _squeeze_all(rows: list[Any], size: int) -> list[tuple[Any, ...]]:
    """``rows`` (oldest step first) in buckets of ``size`` consecutive steps from the
    first, each squeezed into one (the database path's points, in Python)."""
    buckets: dict[int, list[Any]] = {}
    first = rows[0][0]
    for r in rows:
        buckets.setdefault((r[0] - first) // size, []).append(r)
    return [_squeeze(group) for group in buckets.values()]


def _squeeze(rows: list[Any]) -> tuple[Any, ...]:
    def clean(i: int) -> list[float]:
        return [r[i] for r in rows if r[i] is not None]

    mins, meds, maxs, totals, p99s = clean(3), clean(4), clean(5), clean(6), clean(8)
    extreme = None
    if totals:
        mean = sum(totals) / len(totals)
        extreme = max(totals, key=lambda v: abs(v - mean))
    top = max((r for r in rows if r[5] is not None), key=lambda r: r[5], default=rows[0])
    return (
        rows[0][0],
        rows[0][1],
        max(r[2] for r in rows),
        min(mins) if mins else None,
        sum(meds) / len(meds) if meds else None,
        max(maxs) if maxs else None,
        extreme,
        top[7],
        max(p99s) if p99s else None,
    )


def heatmap(
    conn: Connection,
    *,
    run: str,
    metric: str,
    buckets: int = 200,
    from_step: int | None = None,
    to_step: int | None = None,
    use_rollups: bool = True,
) -> Heatmap:
    """``metric`` per rank and step bucket (the max in the bucket), for rank x step heatmaps.

    Cells of 16 steps or more come from the per-rank bucket maxima the rollup worker
    keeps (step_time, compute, exposed_comm, data_wait, loss), so a long run is not
    scanned row by row; their width is then a multiple of 16 or 256 steps.
    """
    run_id = run_id_of(conn, run)
    r = m.rank_steps.c
    value, unit = _per_rank(conn, run_id, metric)
    lo, hi = conn.execute(
        select(func.min(r.step), func.max(r.step)).where(r.run_id == run_id)
    ).one()
    st = m.step_stats.c  # kept when raw rows are pruned: the run's true first step
    first = conn.execute(
        select(func.min(st.step)).where(st.run_id == run_id, st.metric == "step_time")
    ).scalar()
    if first is not None and (lo is None or first < lo):
        lo = first
        if hi is None:  # every raw row pruned
            hi = conn.execute(
                select(func.max(st.step)).where(st.run_id == run_id, st.metric == "step_time")
            ).scalar()
    if lo is None:
        return Heatmap(
            run=run, metric=metric, unit=unit, ranks=[], step_start=[], bucket=1, values=[]
        )
    lo = lo if from_step is None else max(lo, from_step)
    hi = hi if to_step is None else min(hi, to_step)
    if hi < lo:
        return Heatmap(
            run=run, metric=metric, unit=unit, ranks=[], step_start=[], bucket=1, values=[]
        )
    width = max(1, -(-(hi - lo + 1) // buckets))
    level = (
        max((lv for lv in LEVELS if lv <= width), default=None)
        if metric in HEATMAP_COLUMNS
        else None
    )
    if level is not None and use_rollups:
        # From the per-rank bucket maxima: cells are whole stored buckets, aligned to them;
        # read the widest level that tiles them (fewer rows: 64 x 16 steps = 4 x 64).
        width = -(-width // level) * level
        level = max(lv for lv in LEVELS if width % lv == 0)
        lo -= lo % level
    count = (hi - lo) // width + 1
    rows: dict[int, list[float | None]] = {}  # rank: the max per cell
    edge = lo  # the first step not covered by stored bucket maxima
    if level is not None and use_rollups:
        k = m.bucket_maxima.c
        for lv in sorted({level, LEVELS[0]}, reverse=True):  # big closed buckets, then small
            closed = conn.execute(
                select(func.max(k.bucket)).where(
                    k.run_id == run_id, k.metric == metric, k.level == lv
                )
            ).scalar()
            if closed is None or (closed + 1) * lv <= edge:
                continue
            query = select(k.bucket, k.ranks, k.maxima).where(
                k.run_id == run_id,
                k.metric == metric,
                k.level == lv,
                k.bucket >= edge // lv,
                k.bucket <= min(hi // lv, closed),
            )
            found = fetch_rows(conn, query)
            cells = [
                ((bucket * lv - lo) // width, ranks, maxima) for bucket, ranks, maxima in found
            ]
            _bucket_cells(cells, rows, count, one_each=lv == width)
            edge = (closed + 1) * lv
    if edge <= hi:  # raw rows: the open bucket at the run's edge, or everything
        b = (
            r.step - lo
        ) // width  # floor division on both backends (SQLAlchemy 2's / is true division)
        query = select(r.rank, cast(b, Integer).label("cell"), value.label("value")).where(
            r.run_id == run_id, r.step >= edge, r.step <= hi
        )
        _cells(conn, _max_per_cell(query), rows, count)
    ranks = sorted(rows)
    return Heatmap(
        run=run,
        metric=metric,
        unit=unit,
        ranks=ranks,
        step_start=[lo + i * width for i in range(count)],
        bucket=width,
        values=[rows[rank] for rank in ranks],
    )


def _per_rank(conn: Connection, run_id: int, metric: str) -> tuple[Any, str]:
    """(the SQL value of ``metric`` in a ``rank_steps`` row, its unit): a built-in column,
    or a user metric's field of ``metrics`` (a non-finite value is stored as null: a gap)."""
    if metric in METRICS:
        column = METRICS[metric].source
        if column is None:
            raise UnknownMetric(f"{metric} (a heatmap needs a per-rank column metric)")
        return getattr(m.rank_steps.c, column), METRICS[metric].unit
    if not user_metric_reads.has(conn, run_id=run_id, metric=metric):
        raise UnknownMetric(metric, user_metric_reads.names(conn, run_id=run_id))
    return m.rank_steps.c.metrics[user_metrics.field(metric)].as_float(), ""


def _bucket_cells(
    cells: list[tuple[int, list[int], list[float]]],
    rows: dict[int, list[float | None]],
    count: int,
    *,
    one_each: bool,
) -> None:
    """Puts stored buckets' maxima, ``(cell, ranks, maxima)`` (``ranks[i]``'s maximum in
    ``maxima[i]``), into ``rows`` (rank: ``count`` cells), keeping the max per cell. The
    usual case (``one_each``: a bucket a cell, no cells placed yet, every bucket of the
    same ranks) is a transpose in C loops: 1,024 ranks x 156 cells in a few ms."""
    if one_each and not rows and cells and all(c[1] == cells[0][1] for c in cells):
        ranks = cells[0][1]
        columns: list[Any] = [None] * count
        for cell, _, maxima in cells:
            columns[cell] = maxima
        blank = [None] * len(ranks)
        by_rank = zip(*(blank if c is None else c for c in columns), strict=True)
        rows.update(zip(ranks, map(list, by_rank), strict=True))
        return
    for cell, ranks, maxima in cells:
        for rank, value in zip(ranks, maxima, strict=True):
            row = rows.get(rank)
            if row is None:
                row = rows[rank] = [None] * count
            if row[cell] is None or value > row[cell]:  # type: ignore[operator]
                row[cell] = value


def _max_per_cell(query: Any) -> Any:
    """``query``'s (rank, cell, value) rows as one row per rank and cell: the max."""
    q = query.subquery()
    return select(q.c.rank, q.c.cell, func.max(q.c.value).label("value")).group_by(
        q.c.rank, q.c.cell
    )


def _cells(conn: Connection, query: Any, rows: dict[int, list[float | None]], count: int) -> None:
    """Puts the (rank, cell, value) rows of ``query`` (one a rank and cell) into ``rows``
    (rank: ``count`` cells), keeping the max per cell. On PostgreSQL, one row per rank
    with arrays comes back, in binary (a row object per cell, or text arrays to parse,
    cost more than the query itself), and a rank's first cells are placed in one pass."""
    if is_sqlite(conn):
        found: Any = ((rank, [cell], [value]) for rank, cell, value in conn.execute(query))
    else:
        q = query.subquery()
        found = fetch_rows(
            conn,
            select(q.c.rank, func.array_agg(q.c.cell), func.array_agg(q.c.value)).group_by(
                q.c.rank
            ),
        )
    cells_at = range(count)
    for rank, cells, values in found:
        row = rows.get(rank)
        if row is None:  # a cell once a rank: placed by a dict (C loops), not one by one
            placed = dict(zip(cells, values, strict=True))
            rows[rank] = list(map(placed.get, cells_at))
            continue
        for i, value in zip(cells, values, strict=True):
            if value is not None and (row[i] is None or value > row[i]):  # type: ignore[operator]
                row[i] = value


def rank_series(
    conn: Connection,
    *,
    run: str,
    metric: str,
    rank: int,
    from_step: int | None = None,
    to_step: int | None = None,
    last: int | None = None,
) -> RankSeries:
    """``metric`` of one rank per step, from the per-rank rows (a user metric too)."""
    run_id = run_id_of(conn, run)
    r = m.rank_steps.c
    if metric in METRICS:
        definition = METRICS[metric]
        unit, value = definition.unit, definition.value
    elif user_metric_reads.has(conn, run_id=run_id, metric=metric):
        unit, value = "", partial(user_metrics.value_of, user_metrics.field(metric))
    else:
        raise UnknownMetric(metric, user_metric_reads.names(conn, run_id=run_id))
    query = select(m.rank_steps).where(r.run_id == run_id, r.rank == rank)
    if from_step is not None:
        query = query.where(r.step >= from_step)
    if to_step is not None:
        query = query.where(r.step <= to_step)
    if last is not None:
        rows: list[Any] = list(
            reversed(conn.execute(query.order_by(r.step.desc()).limit(last)).mappings().all())
        )
    else:
        rows = list(conn.execute(query.order_by(r.step)).mappings().all())
    return RankSeries(
        run=run,
        metric=metric,
        unit=unit,
        rank=rank,
        step=[row["step"] for row in rows],
        ts=[row["ts"] for row in rows],
        value=[value(row) for row in rows],
    )


# The metrics replaced_steps keeps, each one rank_steps column (the metric's ``source``).
REPLACED_METRICS = tuple(
    m.name for m in catalog.METRICS if m.field is not None and catalog.FIELD[m.field].replaced
)


def replaced_series(
    conn: Connection,
    *,
    run: str,
    metric: str,
    points: int | None = None,
    from_step: int | None = None,
    to_step: int | None = None,
) -> ReplacedSeries:
    """The replaced executions of ``metric`` (loss, grad_norm or step_time) per step:
    min / mean / max across ranks and executions; ``points`` downsamples to at most N
    points (each bucket's min of mins and max of maxes: a spike survives)."""
    run_id = run_id_of(conn, run)
    if metric not in REPLACED_METRICS:
        raise UnknownMetric(metric, known=list(REPLACED_METRICS))
    r = m.replaced_steps.c
    value = r[str(METRICS[metric].source)]
    where = [r.run_id == run_id]
    if from_step is not None:
        where.append(r.step >= from_step)
    if to_step is not None:
        where.append(r.step <= to_step)
    first, last = conn.execute(select(func.min(r.step), func.max(r.step)).where(*where)).one()
    bucket = 1
    if points is not None and first is not None:
        bucket = max(1, -(-(last - first + 1) // points))
    key = r.step - r.step % bucket if bucket > 1 else r.step
    rows = conn.execute(
        select(
            key.label("s"),
            func.count(value),
            func.min(value),
            func.avg(value),
            func.max(value),
            func.min(r.ts),
        )
        .where(*where)
        .group_by(key)
        .order_by(key)
    ).all()
    return ReplacedSeries(
        run=run,
        metric=metric,
        unit=METRICS[metric].unit,
        bucket=bucket,
        step=[int(row[0]) for row in rows],
        ts=[float(row[5]) for row in rows],
        n=[int(row[1]) for row in rows],
        min=[row[2] for row in rows],
        mean=[row[3] for row in rows],
        max=[row[4] for row in rows],
    )
