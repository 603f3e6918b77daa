"""Views of the complete steps of a run (every rank reported them): each rank's compute
against its peers' median and its loss's robust z-score among them, read and computed
once a step and kept between evaluations; from them, the stragglers and the ranks whose
loss diverges.
"""

from __future__ import annotations

import statistics
import weakref
from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, func, select

from trainwarden.alerts.evaluate_metrics import median_without
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import fetch_rows


def median_step_time(conn: Connection, run_id: int) -> float | None:
    """The median of the run's last 20 rolled-up step times (the hung threshold's unit)."""
    s = m.step_stats.c
    rows = conn.execute(
        select(s.median)
        .where(s.run_id == run_id, s.metric == "step_time")
        .order_by(s.step.desc())
        .limit(20)
    ).scalars()
    values = [v for v in rows if v is not None]
    return statistics.median(values) if values else None


@dataclass
class StepView:
    """What the evaluator needs of one step that every rank reported, computed once."""

    ratio: dict[int, float]  # compute / the peers' median compute, per rank
    z: dict[int, float]  # robust z-score of the loss among the ranks (empty under 3 ranks)
    exposed: dict[int, float | None]  # exposed communication seconds, per rank


StepRow = tuple[int, float, float | None, float | None]
"""(rank, compute seconds (the step's when not split), exposed comm seconds, loss)."""


def view_of(rows: list[StepRow]) -> StepView:
    """O(ranks log ranks): ratios via the median without each rank, z via median/MAD."""
    ranked = sorted((compute, rank) for rank, compute, _, _ in rows)
    values = [v for v, _ in ranked]
    ratio = {}
    if len(ranked) >= 2:
        for i, (value, rank) in enumerate(ranked):
            base = median_without(values, i)
            ratio[rank] = value / base if base > 0 else 1.0
    z: dict[int, float] = {}
    losses = {rank: loss for rank, _, _, loss in rows if loss is not None}
    if len(losses) >= 3:
        center = statistics.median(losses.values())
        mad = statistics.median(abs(v - center) for v in losses.values())
        scale = max(1.4826 * mad, 1e-3 * abs(center), 1e-12)
        z = {rank: (value - center) / scale for rank, value in losses.items()}
    return StepView(ratio, z, {rank: exposed for rank, _, exposed, _ in rows})


# Views of complete steps, per database and run: each step is read and computed once,
# not on every evaluation (a run of 4,096 ranks would otherwise be re-read each second).
_views: weakref.WeakKeyDictionary[Engine, dict[int, dict[int, StepView]]] = (
    weakref.WeakKeyDictionary()
)


def recent_views(conn: Connection, run_id: int, world: int, count: int) -> dict[int, StepView]:
    """The newest ``count`` steps that every rank has reported, as views."""
    r = m.rank_steps.c
    newest = conn.execute(
        select(r.step).where(r.run_id == run_id).order_by(r.step.desc()).limit(1)
    ).scalar_one_or_none()
    cache = _views.setdefault(conn.engine, {}).setdefault(run_id, {})
    if newest is None:
        return {}
    if cache and max(cache) > newest:  # the run went back (rollback, restart): start over
        cache.clear()
    lo = newest - 2 * count - 2  # complete steps are the newest ones, give or take
    after = max(lo, max(cache, default=lo))
    counts = conn.execute(
        select(r.step, func.count()).where(r.run_id == run_id, r.step > after).group_by(r.step)
    ).all()
    complete = [step for step, n in counts if n >= world]
    if complete:
        rows = fetch_rows(
            conn,
            select(
                r.step, r.rank, func.coalesce(r.compute_s, r.duration_s), r.exposed_comm_s, r.loss
            ).where(r.run_id == run_id, r.step.in_(complete)),
        )
        by_step: dict[int, list[StepRow]] = defaultdict(list)
        for row in rows:  # plain tuples: 4,096 and more a step, read once each
            by_step[row[0]].append(row[1:])
        for step, ranks in by_step.items():
            cache[step] = view_of(ranks)
    for step in [s for s in cache if s <= lo]:
        del cache[step]
    return {step: cache[step] for step in sorted(cache)[-count:]}


def stragglers(views: dict[int, StepView], *, ratio: float, window: int) -> dict[int, float]:
    """Ranks slower than ``ratio`` x their peers' median compute on each of the last
    ``window`` steps: {rank: median ratio}."""
    if len(views) < window:
        return {}
    steps = [views[step].ratio for step in sorted(views)[-window:]]
    # Only a rank slow on the newest step can be slow on all of them: that handful is
    # checked, not every rank of every step on every evaluation (once a second).
    out = {}
    for rank in [r for r, v in steps[-1].items() if v > ratio]:
        values = [s[rank] for s in steps if rank in s]
        if len(values) == window and all(v > ratio for v in values):
            out[rank] = statistics.median(values)
    return out


def diverging(views: dict[int, StepView], *, z: float, window: int) -> dict[int, tuple[float, int]]:
    """Ranks whose loss is a robust outlier among peers on each of the last ``window``
    steps: {rank: (median z, first step of the streak)}."""
    ordered = sorted(views)[-window:]
    if len(ordered) < window or any(not views[step].z for step in ordered):
        return {}
    steps = [views[step].z for step in ordered]
    out = {}
    for rank in [r for r, v in steps[-1].items() if abs(v) > z]:  # as for stragglers
        values = [s[rank] for s in steps if rank in s]
        if len(values) == window and all(abs(v) > z for v in values):
            out[rank] = (statistics.median(values), ordered[0])
    return out
