"""The per-step metric catalog: each metric defined once, with where its per-rank value
comes from (a ``rank_steps`` row) and what its run-level ``total`` means.

Pure definitions: the rules (``alerts.rules``) name these metrics, the evaluator
(``alerts.evaluate``) computes them, and the collector's rollups (``collector/rollups``)
store them per step across ranks (their SQL twins must agree: a test compares them).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MetricDef:
    name: str
    label: str
    unit: str
    value: Callable[[Mapping[str, Any]], float | None]
    """The per-rank value from a ``rank_steps`` row."""
    total: Callable[[list[Mapping[str, Any]]], float | None]
    """The run-level value at one step, from all ranks' rows."""
    source: str | None = None
    """The ``rank_steps`` column the value comes from, if it is one column."""


def _col(name: str) -> Callable[[Mapping[str, Any]], float | None]:
    return lambda row: row[name]


def _sum_of(name: str) -> Callable[[list[Mapping[str, Any]]], float | None]:
    def total(rows: list[Mapping[str, Any]]) -> float | None:
        values = [row[name] for row in rows if row[name] is not None]
        return float(sum(values)) if values else None

    return total


def _max_of(name: str) -> Callable[[list[Mapping[str, Any]]], float | None]:
    def total(rows: list[Mapping[str, Any]]) -> float | None:
        values = [row[name] for row in rows if row[name] is not None]
        return float(max(values)) if values else None

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


def _mean_of(name: str) -> Callable[[list[Mapping[str, Any]]], float | None]:
    def total(rows: list[Mapping[str, Any]]) -> float | None:
        values = [row[name] for row in rows if row[name] is not None and math.isfinite(row[name])]
        return statistics.fmean(values) if values else None

    return total


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


def _mean_by(
    value: Callable[[Mapping[str, Any]], float | None],
) -> Callable[[list[Mapping[str, Any]]], float | None]:
    def total(rows: list[Mapping[str, Any]]) -> float | None:
        values = [v for v in map(value, rows) if v is not None and math.isfinite(v)]
        return statistics.fmean(values) if values else None

    return total


def _part(name: str, label: str, column: str) -> MetricDef:
    """A part of the step-time breakdown: its run-level value is the mean over ranks."""
    return MetricDef(name, label, "s", _col(column), _mean_of(column), column)


METRICS: dict[str, MetricDef] = {
    m.name: m
    for m in [
        # total = the slowest rank's time: the whole job waits for it.
        MetricDef(
            "step_time", "Step time", "s", _col("duration_s"), _max_of("duration_s"), "duration_s"
        ),
        MetricDef(
            "data_wait",
            "Data wait",
            "s",
            _col("data_wait_s"),
            _max_of("data_wait_s"),
            "data_wait_s",
        ),
        MetricDef("loss", "Loss", "", _col("loss"), _mean_of("loss"), "loss"),
        MetricDef(
            "tokens", "Tokens per step", "tokens", _col("tokens"), _sum_of("tokens"), "tokens"
        ),
        MetricDef("tokens_per_s", "Throughput", "tokens/s", _rank_tokens_per_s, _run_tokens_per_s),
        MetricDef("mfu", "MFU", "", _col("mfu"), _run_mfu, "mfu"),
        MetricDef(
            "grad_norm", "Grad norm", "", _col("grad_norm"), _max_of("grad_norm"), "grad_norm"
        ),
        _part("compute", "Compute", "compute_s"),
        _part("exposed_comm", "Exposed comm", "exposed_comm_s"),
        _part("overlapped_comm", "Overlapped comm", "overlapped_comm_s"),
        _part("idle", "Idle", "idle_s"),
        _part("forward", "Forward", "fwd_s"),
        _part("backward", "Backward", "bwd_s"),
        _part("optimizer", "Optimizer", "opt_s"),
        _part("other", "Other", "other_s"),
        MetricDef(
            "exposed_comm_frac",
            "Exposed comm / step",
            "",
            _exposed_fraction,
            _mean_by(_exposed_fraction),
        ),
        MetricDef(
            "mem_allocated",
            "GPU memory (max allocated)",
            "bytes",
            _col("mem_allocated_bytes"),
            _max_of("mem_allocated_bytes"),
            "mem_allocated_bytes",
        ),
        MetricDef(
            "rss",
            "Host memory (peak RSS)",
            "bytes",
            _col("rss_bytes"),
            _max_of("rss_bytes"),
            "rss_bytes",
        ),
    ]
}
