"""Per-step aggregates across ranks (``step_stats``), computed as records arrive.

Each metric is defined once, in ``trainwarden.alerts.metrics`` (where its per-rank value
comes from and what its run-level ``total`` means); here are its aggregates across
ranks, in Python and as SQL. The UI and the series API read only these rollups, never
every rank's row.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from trainwarden.agent import metric_catalog as catalog
from trainwarden.alerts.metrics import METRICS, MetricDef

_LONGEST = "max(duration_s)"
_RATED = "flops IS NOT NULL AND peak_flops <> 0"
_DERIVED_SQL = {  # metric: (per-rank value or None: its field; run-level total), as in Python
    "tokens_per_s": (
        "tokens / NULLIF(duration_s, 0)",
        f"CASE WHEN count(tokens) = 0 OR coalesce({_LONGEST}, 0) = 0 THEN NULL "
        f"ELSE sum(tokens) / {_LONGEST} END",
    ),
    "mfu": (
        None,
        f"CASE WHEN count(*) FILTER (WHERE {_RATED}) = 0 OR coalesce({_LONGEST}, 0) = 0 THEN NULL "
        f"ELSE sum(flops) FILTER (WHERE {_RATED}) / ({_LONGEST} * sum(peak_flops) FILTER "
        f"(WHERE {_RATED})) END",
    ),
    "exposed_comm_frac": (
        "exposed_comm_s / NULLIF(duration_s, 0)",
        "avg(exposed_comm_s / NULLIF(duration_s, 0))",
    ),
}
_ACROSS_SQL = {"max": "max", "mean": "avg", "sum": "sum"}


def sql_of(metric: MetricDef) -> tuple[str, str]:
    """``metric``'s per-rank value and run-level total as SQL over ``rank_steps``."""
    across = catalog.METRIC[metric.name].across
    if across == "derived":
        value, total = _DERIVED_SQL[metric.name]
        return value or str(metric.source), total
    return str(metric.source), f"{_ACROSS_SQL[across]}({metric.source})"


def aggregate_sql() -> str:
    """One SELECT that rolls up ``keys`` steps of one run in PostgreSQL: a row per step
    with, per metric, the columns ``aggregate`` computes in Python (the GROUP BY runs
    next to the data, not in the collector's one Python core). The slowest rank is
    ``max(ARRAY[value, rank])``: the highest value, the highest rank among equals, in
    one pass (``array_agg(rank ORDER BY value DESC)`` sorted every metric's values again)."""
    parts = [
        "step",
        "min(ts) AS ts",
        "count(*) AS rows_n",
        "max(recv_ts) AS newest",
        "count(metrics) AS user_n",
    ]
    for i, metric in enumerate(METRICS.values()):
        value, total = sql_of(metric)
        v = f"({value})::float8"
        bad = (
            f"count(*) FILTER (WHERE issues->>'{metric.source}' IN ('nan', 'inf', '-inf'))"
            if metric.source
            else "0"
        )
        parts += [
            f"count({v}) AS n{i}",
            f"{bad} AS bad{i}",
            f"min({v}) AS min{i}",
            f"percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY {v}) AS pct{i}",
            f"max({v}) AS max{i}",
            f"avg({v}) AS mean{i}",
            f"({total})::float8 AS total{i}",
            f"((max(ARRAY[{v}, rank::float8]) FILTER (WHERE {v} IS NOT NULL))[2])::int AS top{i}",
        ]
    return (
        f"SELECT {', '.join(parts)} FROM rank_steps "
        "WHERE run_id = :run AND step = ANY(:steps) GROUP BY step"
    )


def stats_from_sql(run_id: int, row: Any) -> Iterable[dict[str, Any]]:
    """``step_stats`` rows from one row of ``aggregate_sql``, as ``aggregate`` yields them."""
    for i, metric in enumerate(METRICS.values()):
        stat = _column_stat(run_id, row, i, metric.name, row["ts"], total=f"total{i}")
        if stat is not None:
            yield stat


def _column_stat(
    run_id: int, row: Any, i: int, metric: str, ts: float, *, total: str
) -> dict[str, Any] | None:
    """The ``step_stats`` row of the ``i``-th metric's columns of an aggregate row (None
    when no rank sent a value or a non-finite one); ``total``: the column of its total."""
    n, bad = row[f"n{i}"], row[f"bad{i}"]
    if not n and not bad:
        return None
    return {
        "run_id": run_id,
        "metric": metric,
        "step": row["step"],
        "ts": ts,
        "n": n,
        "nonfinite": bad,
        "min": row[f"min{i}"],
        **_percentiles(row[f"pct{i}"]),
        "max": row[f"max{i}"],
        "mean": row[f"mean{i}"],
        "total": row[total],
        "argmax_rank": row[f"top{i}"],
    }


USER_PREFIX = "user."  # a user metric's step_stats name: user.<name> (see user_metrics)

USER_KEYS_SQL = (  # the user metrics some rank sent at these steps
    "SELECT DISTINCT jsonb_object_keys(metrics) FROM rank_steps "
    "WHERE run_id = :run AND step = ANY(:steps) AND metrics IS NOT NULL"
)
USER_CHUNK = 16  # user metrics rolled up by one statement


def aggregate_user_sql(n: int) -> str:
    """``aggregate_sql`` for ``n`` user metrics (``rank_steps.metrics``, JSONB), whose
    names are bound as ``:k0`` ... : a row per step, each metric's value taken out of the
    row once (``OFFSET 0`` keeps the subquery from being flattened into the aggregates,
    which would take each value out again for each). A third of the time of unpacking
    every row with ``jsonb_each_text`` and grouping by name (8,192 ranks: 282 ms a step)."""
    taken = ", ".join(
        f"(metrics->>CAST(:k{i} AS text))::float8 AS v{i}, "
        f"jsonb_exists(metrics, CAST(:k{i} AS text)) "
        f"AND issues->>('user.' || CAST(:k{i} AS text)) IN ('nan', 'inf', '-inf') AS bad{i}"
        for i in range(n)
    )
    parts = ["step"]
    for i in range(n):
        v = f"v{i}"
        parts += [
            f"count({v}) AS n{i}",
            f"count(*) FILTER (WHERE bad{i}) AS bad{i}",
            f"min({v}) AS min{i}",
            f"percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY {v}) AS pct{i}",
            f"max({v}) AS max{i}",
            f"avg({v}) AS mean{i}",
            f"((max(ARRAY[{v}, rank::float8]) FILTER (WHERE {v} IS NOT NULL))[2])::int AS top{i}",
        ]
    return (
        f"SELECT {', '.join(parts)} FROM (SELECT step, rank, {taken} FROM rank_steps "
        "WHERE run_id = :run AND step = ANY(:steps) AND metrics IS NOT NULL OFFSET 0) AS s "
        "GROUP BY step"
    )


def user_stats_from_sql(
    run_id: int, row: Any, names: list[str], ts: float
) -> Iterable[dict[str, Any]]:
    """``step_stats`` rows from one row of ``aggregate_user_sql(len(names))`` (``ts``:
    the step's time; a user metric's total is its mean over the ranks); none for a
    metric no rank of the step sent."""
    for i, name in enumerate(names):
        stat = _column_stat(run_id, row, i, USER_PREFIX + name, ts, total=f"mean{i}")
        if stat is not None:
            yield stat


def _percentiles(found: list[float | None] | None) -> dict[str, float | None]:
    """median and p99 from ``percentile_cont(ARRAY[0.5, 0.99])`` (one sort for both)."""
    median, p99 = found if found else (None, None)
    return {"median": median, "p99": p99}


def percentile(ordered: list[float], fraction: float) -> float:
    """``percentile_cont``: linear interpolation between the closest ranks of sorted values."""
    at = fraction * (len(ordered) - 1)
    below = math.floor(at)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (at - below)


NONFINITE = frozenset({"nan", "inf", "-inf"})
"""How a non-finite value is marked in a row's ``issues`` (SQLite cannot store NaN)."""


def _nonfinite(rows: list[Mapping[str, Any]], column: str | None) -> int:
    """How many rows marked ``column`` (an issues key) non-finite."""
    if column is None:
        return 0
    return sum(1 for row in rows if (row["issues"] or {}).get(column) in NONFINITE)


def aggregate(run_id: int, step: int, rows: list[Mapping[str, Any]]) -> Iterable[dict[str, Any]]:
    """One ``step_stats`` row per metric that some rank reports at ``step``, built-in
    and user metrics (``user.<name>``, whose run-level total is the mean over ranks)."""
    ts = min(row["ts"] for row in rows)
    for metric in METRICS.values():
        ranked = [(metric.value(row), row["rank"]) for row in rows]
        stat = _stat(ranked, _nonfinite(rows, metric.source), partial(metric.total, rows))
        if stat is not None:
            yield {"run_id": run_id, "metric": metric.name, "step": step, "ts": ts, **stat}
    user: dict[str, list[tuple[float | None, int]]] = {}
    for row in rows:
        for name, value in (row.get("metrics") or {}).items():
            user.setdefault(name, []).append((value, row["rank"]))
    for name, ranked in user.items():
        key = USER_PREFIX + name
        stat = _stat(ranked, _nonfinite(rows, key), None)
        if stat is not None:
            yield {"run_id": run_id, "metric": key, "step": step, "ts": ts, **stat}


def _stat(
    ranked: list[tuple[float | None, int]],
    marked: int,
    total: Callable[[], float | None] | None,
) -> dict[str, Any] | None:
    """The across-ranks columns of one metric from its (value, rank) pairs; ``marked``:
    ranks whose non-finite value was stored as null. ``total``: the run-level value
    (``None``: the mean). ``None`` when no rank reports the metric."""
    present = [(v, r) for v, r in ranked if v is not None]
    finite = [(v, r) for v, r in present if math.isfinite(v)]
    nonfinite = len(present) - len(finite) + marked
    if not present and not nonfinite:
        return None
    values = sorted(v for v, _ in finite)
    top = max(finite, default=None)
    mean = statistics.fmean(values) if values else None
    return {
        "n": len(present),
        "nonfinite": nonfinite,
        "min": values[0] if values else None,
        "median": statistics.median(values) if values else None,
        "max": values[-1] if values else None,
        "p99": percentile(values, 0.99) if values else None,
        "mean": mean,
        "total": mean if total is None else total(),
        "argmax_rank": top[1] if top else None,
    }
