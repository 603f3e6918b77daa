"""The per-step metrics as the alerts compute them: each metric of the catalog
(``trainwarden.agent.metric_catalog``) with where its per-rank value comes from (a
``rank_steps`` row) and what its run-level ``total`` means, as Python functions.

Pure definitions: the rules (``alerts.rules``) name these metrics, the evaluator
(``alerts.evaluate``) computes them, and the collector's rollups (``collector/rollups``)
store them per step across ranks (their SQL twins must agree: a test compares them). A
metric of one field, rolled up as the slowest rank's, the mean or the sum, needs nothing
here; a ``derived`` one has its functions in :data:`_DERIVED`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trainwarden.agent.metric_catalog import METRICS as CATALOG
from trainwarden.agent.metric_catalog import StepMetric

Value = Callable[[Mapping[str, Any]], float | None]
Total = Callable[[list[Mapping[str, Any]]], float | None]


@dataclass(frozen=True)
class MetricDef:
    name: str
    label: str
    unit: str
    value: Value
    """The per-rank value from a ``rank_steps`` row."""
    total: Total
    """The run-level value at one step, from all ranks' rows."""
    source: str | None = None
    """The ``rank_steps`` column the value comes from, if it is one column."""


def _col(name: str) -> Value:
    return lambda row: row[name]


def _sum_of(name: str) -> Total:
    def total(rows: list[Mapping[str, Any]]) -> float | None:
        values = [row[name] for row in rows if row[name] is not None]
        return float(sum(values)) if values else None

    return total


def _max_of(name: str) -> Total:
    def total(rows: list[Mapping[str, Any]]) -> float | None:
        values = [row[name] for row in rows if row[name] is not None]
        return float(max(values)) if values else None

    return total


def _mean_of(name: str) -> Total:
    def total(rows: list[Mapping[str, Any]]) -> float | None:
        values = [row[name] for row in rows if row[name] is not None and math.isfinite(row[name])]
        return statistics.fmean(values) if values else None

    return total


def _rank_tokens_per_s(row: Mapping[str, Any]) -> float | None:
    if row["tokens"] is None or not row["duration_s"]:
        return None
    return row["tokens"] / row["duration_s"]


def _run_tokens_per_s(rows: list[Mapping[str, Any]]) -> float | None:
    # The step finishes when its slowest rank does: all tokens over the longest duration.
    tokens = [r["tokens"] for r in rows if r["tokens"] is not None]
    longest = max((r["duration_s"] for r in rows), default=0.0)
    if not tokens or not longest:
        return None
    return sum(tokens) / longest


def _run_mfu(rows: list[Mapping[str, Any]]) -> float | None:
    # Across the world: all ranks' FLOPs over the slowest rank's time x all ranks' peaks.
    rated = [r for r in rows if r["flops"] is not None and r["peak_flops"]]
    longest = max((r["duration_s"] for r in rows), default=0.0)
    if not rated or not longest:
        return None
    return sum(r["flops"] for r in rated) / (longest * sum(r["peak_flops"] for r in rated))


def _exposed_fraction(row: Mapping[str, Any]) -> float | None:
    if row["exposed_comm_s"] is None or not row["duration_s"]:
        return None
    return row["exposed_comm_s"] / row["duration_s"]


def _mean_by(value: Value) -> Total:
    def total(rows: list[Mapping[str, Any]]) -> float | None:
        values = [v for v in map(value, rows) if v is not None and math.isfinite(v)]
        return statistics.fmean(values) if values else None

    return total


_DERIVED: dict[str, tuple[Value | None, Total]] = {
    # metric: (its per-rank value, None: its field's; its run-level total)
    "tokens_per_s": (_rank_tokens_per_s, _run_tokens_per_s),
    "mfu": (None, _run_mfu),
    "exposed_comm_frac": (_exposed_fraction, _mean_by(_exposed_fraction)),
}
_ACROSS = {"max": _max_of, "mean": _mean_of, "sum": _sum_of}


def _define(metric: StepMetric) -> MetricDef:
    if metric.across == "derived":
        value, total = _DERIVED[metric.name]
    else:
        value, total = None, _ACROSS[metric.across](str(metric.field))
    if value is None:
        value = _col(str(metric.field))
    return MetricDef(metric.name, metric.label, metric.unit, value, total, metric.field)


METRICS: dict[str, MetricDef] = {m.name: _define(m) for m in CATALOG}
