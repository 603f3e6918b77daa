"""The metric rule kinds over a snapshot: ``threshold`` (a metric's series against a
bound), ``baseline`` (against its own recent past) and ``peer`` (a rank against the
other ranks of one step), with the series arithmetic they share: windows, medians, and
the onset step of the streak that holds now.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from trainwarden.alerts.metrics import METRICS

from .intervals import Interval
from .rules import (
    BaselineRule,
    PeerRule,
    ThresholdRule,
)
from .snapshot import Row, Snapshot, Verdict, rank_detail


def is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _median(values: Iterable[float]) -> float | None:
    finite = [v for v in values if is_finite(v)]
    return statistics.median(finite) if finite else None


def _rank_value(metric: str, row: Row) -> float | None:
    value = METRICS[metric].value(row)
    return float(value) if is_finite(value) else None


def _window(
    points: Sequence[tuple[int, float, float]], window: Interval | None, now: float
) -> list[float]:
    """The values of ``(step, ts, value)`` points within ``window`` of the newest (or
    of ``now`` for a duration); the newest value alone when no window is given."""
    if not points:
        return []
    if window is None:
        return [points[-1][2]]
    if window.unit == "steps":
        return [v for _, _, v in points[-int(window.value) :]]
    return [v for _, ts, v in points if ts > now - window.value]


def _split(
    points: Sequence[tuple[int, float, float]],
    window: Interval | None,
    baseline: Interval,
    now: float,
):  # type: ignore[no-untyped-def]  # noqa: E501
    """(recent window, the baseline just before it) of ``points``."""
    if window is None:
        recent, rest = list(points[-1:]), list(points[:-1])
    elif window.unit == "steps":
        n = int(window.value)
        recent, rest = list(points[-n:]), list(points[:-n])
    else:
        recent = [p for p in points if p[1] > now - window.value]
        rest = [p for p in points if p[1] <= now - window.value]
    if baseline.unit == "steps":
        base = rest[-int(baseline.value) :]
        wanted = max(3, int(baseline.value) // 4)
    else:
        start = recent[0][1] if recent else now
        base = [p for p in rest if p[1] > start - baseline.value]
        wanted = 3
    return [p[2] for p in recent], [p[2] for p in base], len(base) >= wanted


def _compare(value: float, above: float | None, below: float | None) -> bool:
    return (above is not None and value > above) or (below is not None and value < below)


def _onset(
    points: Sequence[tuple[int, float, float]], holds: Callable[[float], bool], window: int
) -> int | None:
    """The step at which the streak of ``points`` that holds now began, scanning back
    from the newest. A point belongs to the streak if its own value holds, or if the
    median of the ``window`` points ending at it does (a noisy point inside the streak
    does not end it); the onset is the earliest point of the streak whose own value
    holds. ``None`` when nothing holds."""
    onset = None
    for i in range(len(points) - 1, -1, -1):
        own = holds(points[i][2])
        if not own:
            around = _median(p[2] for p in points[max(0, i - window + 1) : i + 1])
            if around is None or not holds(around):
                break
        else:
            onset = points[i][0]
    return onset


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def threshold(rule: ThresholdRule, snap: Snapshot) -> list[Verdict]:
    p = rule.params
    bound = (
        f"> {_fmt(p.above)}" if p.above is not None else f"< {_fmt(p.below)}"  # type: ignore[arg-type]
    )
    what = f"{p.metric}{' / step time' if p.fraction_of_step else ''}"
    out = []
    for rank, points in _series(snap, p.scope, p.metric, p.stat, p.fraction_of_step).items():
        recent = _window(points, p.window, snap.now)
        value = _median(recent)
        if value is not None and _compare(value, p.above, p.below):
            who = "run" if rank is None else rank_detail(snap, rank)
            span = f" (median over {p.window})" if p.window else ""
            onset = None
            if p.scope != "gpu":  # GPU samples are timed, not stepped
                onset = _onset(points, lambda v: _compare(v, p.above, p.below), len(recent))
            out.append(
                Verdict(
                    rank,
                    value,
                    f"{who}: {what} {_fmt(value)}{span}, threshold {bound}",
                    points[-1][0] if p.scope != "gpu" else snap.last_step,
                    onset,
                )
            )
    return out


def _series(
    snap: Snapshot, scope: str, metric: str, stat: str | None, fraction: bool = False
) -> dict[int | None, list[tuple[int, float, float]]]:
    """``(step, ts, value)`` points per rank (None: the run), in order."""
    out: dict[int | None, list[tuple[int, float, float]]] = defaultdict(list)
    if scope == "run":
        assert stat is not None
        rows = snap.stats.get(metric, [])
        divisor = (
            {r.step: r.values.get(stat) for r in snap.stats.get("step_time", [])}
            if fraction
            else {}
        )
        for r in rows:
            value = r.values.get(stat)
            if fraction:
                step_time = divisor.get(r.step)
                value = (
                    value / step_time  # type: ignore[operator]
                    if is_finite(value) and is_finite(step_time) and step_time
                    else None
                )
            if is_finite(value):
                out[None].append((r.step, r.ts, float(value)))  # type: ignore[arg-type]
    elif scope == "rank":
        for row in snap.steps:
            value = _rank_value(metric, row)
            if fraction and value is not None:
                value = value / row["duration_s"] if row["duration_s"] else None
            if value is not None:
                out[row["rank"]].append((row["step"], row["ts"], value))
    else:  # gpu samples: timed, not stepped
        for row in snap.gpu:
            if is_finite(row.get(metric)):
                out[row["rank"]].append((0, row["ts"], float(row[metric])))
    return out


def baseline(rule: BaselineRule, snap: Snapshot) -> list[Verdict]:
    p = rule.params
    out = []
    for rank, points in _series(snap, p.scope, p.metric, p.stat).items():
        if p.warmup.value:
            if p.warmup.unit == "steps":
                first = (
                    snap.first_step
                    if snap.first_step is not None
                    else (points[0][0] if points else 0)
                )
                points = [pt for pt in points if pt[0] >= first + p.warmup.value]
            elif snap.started_at is not None:
                points = [pt for pt in points if pt[1] >= snap.started_at + p.warmup.value]
        recent, base, enough = _split(points, p.window, p.baseline, snap.now)
        now_value, base_value = _median(recent), _median(base)
        if not enough or now_value is None or not base_value:
            continue
        ratio = now_value / base_value
        if _compare(ratio, p.ratio_above, p.ratio_below):
            who = "run" if rank is None else rank_detail(snap, rank)
            onset = _baseline_onset(rule, points, base_value, len(recent))
            out.append(
                Verdict(
                    rank,
                    ratio,
                    f"{who}: {p.metric} {_fmt(now_value)} is {ratio:.2f}x its baseline "
                    f"{_fmt(base_value)} (median of the previous {p.baseline})",
                    points[-1][0],
                    onset,
                )
            )
    return out


def _baseline_onset(
    rule: BaselineRule, points: Sequence[tuple[int, float, float]], base: float, window: int
) -> int | None:
    """Where a baseline rule's streak began: each step's value against the baseline. A
    pass that noticed late has part of the streak inside its baseline; the baseline is
    taken again from the points before the onset found, and the scan repeated once."""
    p = rule.params

    def holds(reference: float) -> Callable[[float], bool]:
        return lambda v: _compare(v / reference, p.ratio_above, p.ratio_below)

    onset = _onset(points, holds(base), window)
    if onset is None:
        return None
    before = [pt for pt in points if pt[0] < onset]
    if p.baseline.unit == "steps":
        before = before[-int(p.baseline.value) :]
    elif before:
        before = [pt for pt in before if pt[1] > before[-1][1] - p.baseline.value]
    clean = _median(pt[2] for pt in before)
    if clean and clean != base:
        return _onset(points, holds(clean), window) or onset
    return onset


def _complete_step(snap: Snapshot, min_ranks: int) -> tuple[int, dict[int, Row]] | None:
    """The newest step every live rank reported (or as many as ever reported one step)."""
    by_step = snap.by_step()
    if not by_step:
        return None
    live = {r.rank for r in snap.live()}
    widest = max(len(rows) for rows in by_step.values())
    need = max(min_ranks, len(live) if live else widest)
    for step in sorted(by_step, reverse=True):
        rows = by_step[step]
        if len(rows) >= need or (live and live <= rows.keys() and len(rows) >= min_ranks):
            return step, rows
    return None


def peer(rule: PeerRule, snap: Snapshot) -> list[Verdict]:
    p = rule.params
    found = _complete_step(snap, p.min_ranks)
    if found is None:
        return []
    step, rows = found
    values = sorted(
        (v, rank) for rank, row in rows.items() if (v := _rank_value(p.metric, row)) is not None
    )
    if len(values) < p.min_ranks:
        return []
    out = []
    if p.z_above is not None:
        center = statistics.median(v for v, _ in values)
        mad = statistics.median(abs(v - center) for v, _ in values)
        scale = max(1.4826 * mad, 1e-3 * abs(center), 1e-12)
        for value, rank in values:
            z = (value - center) / scale
            if abs(z) > p.z_above:
                out.append(
                    Verdict(
                        rank,
                        z,
                        f"{rank_detail(snap, rank)}: {p.metric} {_fmt(value)} is {z:+.1f} robust "
                        f"z from its peers' median {_fmt(center)} at step {step}",
                        step,
                    )
                )
        return out
    ordered = [v for v, _ in values]
    for i, (value, rank) in enumerate(values):
        others = median_without(ordered, i)
        if others <= 0:
            continue
        ratio = value / others
        if _compare(ratio, p.ratio_above, p.ratio_below):
            out.append(
                Verdict(
                    rank,
                    ratio,
                    f"{rank_detail(snap, rank)}: {p.metric} {_fmt(value)} is {ratio:.2f}x "
                    f"its peers' median {_fmt(others)} at step {step}",
                    step,
                )
            )
    return out


def median_without(values: list[float], i: int) -> float:
    """The median of sorted ``values`` without the element at index ``i``, in O(1)."""
    n = len(values) - 1

    def at(k: int) -> float:  # the k-th element once index i is removed
        return values[k if k < i else k + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2
