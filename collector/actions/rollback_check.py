"""Whether a rollback worked: the alert's own rule, over the steps run again after the restore.

A rollback that restores a checkpoint already holding the corruption (saved after the
spiked update, or corrupted on disk) replays the anomaly. The action engine does not end
such a rollback ``done``: once every rank has restored, it waits for the first steps run
again and asks the rule that fired whether its condition still holds on them:

- a **baseline** or **threshold** rule of the run (LossSpike): its window over the
  replayed steps, against a baseline of the steps up to the restored checkpoint (which the
  replay did not touch), the comparison the rule itself makes (``alerts.evaluate``);
- a rule of each rank: the same over each rank's rows;
- an **event** rule on a record's flags or non-finite values (NonFiniteLoss): any replayed
  step that matches.

Other rule kinds (an XID, a dead rank) say nothing about the weights: not checked.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from trainwarden.alerts.evaluate import evaluate
from trainwarden.alerts.rules import (
    BaselineRule,
    EventRule,
    FlagMatch,
    NonFiniteMatch,
    Rule,
    ThresholdRule,
)
from trainwarden.alerts.snapshot import Snapshot, StatRow
from trainwarden.collector.rollups.aggregate import aggregate
from trainwarden.collector.store import models as m

MIN_STEPS = 5
"""Replayed steps looked at, at least (more where the rule's window is longer)."""


@dataclass(frozen=True)
class ReplayCheck:
    ready: bool
    """Enough replayed steps have arrived to judge (else: wait)."""
    holds: bool = False
    """The rule's condition still holds on them: the rollback did not fix it."""
    detail: str = ""
    steps: tuple[int, int] | None = None
    """The replayed steps judged (first, last)."""


def checkable(rule: Rule | None) -> bool:
    """Whether a replay can tell that ``rule``'s anomaly is gone."""
    if isinstance(rule, (BaselineRule, ThresholdRule)):
        return rule.params.scope in ("run", "rank")
    return isinstance(rule, EventRule) and isinstance(rule.params, (FlagMatch, NonFiniteMatch))


def steps_needed(rule: Rule, at_least: int) -> int:
    window = getattr(rule.params, "window", None)
    wanted = int(window.value) if window is not None and window.unit == "steps" else 1
    return max(at_least, wanted, 1)


def check_replay(
    conn: Connection,
    *,
    rule: Rule,
    run_id: int,
    ranks: Sequence[int],
    checkpoint_step: int,
    since_ts: float,
    need: int,
    now: float,
) -> ReplayCheck:
    """``rule`` over the first ``need`` steps that every one of ``ranks`` ran again after
    restoring ``checkpoint_step`` (rows stamped at or after ``since_ts``, the ranks' own
    clock when they restored)."""
    k = m.rank_steps.c
    by_step: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for row in conn.execute(
        select(m.rank_steps)
        .where(
            k.run_id == run_id,
            k.step > checkpoint_step,
            k.ts >= since_ts,
            k.rank.in_(list(ranks)),
        )
        .order_by(k.step)
    ).mappings():
        by_step[row["step"]][row["rank"]] = dict(row)
    complete: list[int] = []  # consecutive steps from the first run again, on every rank
    for s in sorted(by_step):
        if len(by_step[s]) < len(ranks) or (complete and s != complete[-1] + 1):
            break
        complete.append(s)
    complete = complete[:need]
    if len(complete) < need:
        return ReplayCheck(ready=False, detail=f"{len(complete)} of {need} replayed steps so far")
    replay = [row for s in complete for row in by_step[s].values()]
    snap = Snapshot(run="", now=now, last_step=complete[-1], hold_s=float("inf"))
    p = rule.params
    if isinstance(rule, (BaselineRule, ThresholdRule)) and p.scope == "run":
        snap.stats[p.metric] = _history(conn, rule, run_id, checkpoint_step) + [
            StatRow(s, min(r["ts"] for r in by_step[s].values()), stat)
            for s in complete
            for stat in _stats(run_id, s, list(by_step[s].values()), p.metric)
        ]
        snap.first_step = _first_step(conn, run_id, p.metric)
    elif isinstance(rule, (BaselineRule, ThresholdRule)):
        snap.steps = _rank_history(conn, rule, run_id, checkpoint_step, ranks) + replay
        snap.first_step = _first_step(conn, run_id, "loss")
    else:
        snap.marked = [{**row, "recv_ts": now} for row in replay if row["flags"] or row["issues"]]
    steps = (complete[0], complete[-1])
    if isinstance(rule, BaselineRule) and not _enough_baseline(rule, snap, checkpoint_step):
        return ReplayCheck(
            ready=True,
            detail=f"not checked: too little history up to step "
            f"{checkpoint_step} for {rule.name}'s baseline",
            steps=steps,
        )
    found = evaluate(rule, snap)
    if found:
        return ReplayCheck(ready=True, holds=True, detail=found[0].detail, steps=steps)
    return ReplayCheck(
        ready=True,
        detail=f"{rule.name} no longer holds on steps {steps[0]}-{steps[1]} run again",
        steps=steps,
    )


def _enough_baseline(rule: BaselineRule, snap: Snapshot, upto: int) -> bool:
    """Whether the steps before the replay give the rule a baseline (else it would say
    nothing, which is not the same as the anomaly being gone)."""
    p = rule.params
    if p.scope == "run":
        steps = [row.step for row in snap.stats.get(p.metric, []) if row.step <= upto]
    else:
        steps = sorted({row["step"] for row in snap.steps if row["step"] <= upto})
    if p.warmup.unit == "steps" and p.warmup.value:
        first = snap.first_step if snap.first_step is not None else (steps[0] if steps else 0)
        steps = [s for s in steps if s >= first + p.warmup.value]
    wanted = max(3, int(p.baseline.value) // 4) if p.baseline.unit == "steps" else 3
    return len(steps) >= wanted


def _stats(
    run_id: int, step: int, rows: list[Mapping[str, Any]], metric: str
) -> list[dict[str, Any]]:
    return [s for s in aggregate(run_id, step, rows) if s["metric"] == metric]


def _history(conn: Connection, rule: Rule, run_id: int, upto: int) -> list[StatRow]:
    """The run's rolled-up ``metric`` up to the restored checkpoint: the rule's baseline,
    untouched by the replay."""
    p = rule.params
    back = 1
    if isinstance(rule, BaselineRule) and p.baseline.unit == "steps":
        back = int(p.baseline.value) + 1
    elif isinstance(rule, BaselineRule):
        back = 10_000  # a baseline in time: bounded here, cut to its span by the rule
    s = m.step_stats.c
    rows = conn.execute(
        select(s.step, s.ts, s.min, s.median, s.max, s.p99, s.mean, s.total)
        .where(s.run_id == run_id, s.metric == p.metric, s.step <= upto)
        .order_by(s.step.desc())
        .limit(back)
    ).all()
    return [
        StatRow(
            r.step,
            r.ts,
            {
                "min": r.min,
                "median": r.median,
                "max": r.max,
                "p99": r.p99,
                "mean": r.mean,
                "total": r.total,
            },
        )
        for r in reversed(rows)
    ]


def _rank_history(
    conn: Connection, rule: Rule, run_id: int, upto: int, ranks: Sequence[int]
) -> list[dict[str, Any]]:
    p = rule.params
    back = (
        int(p.baseline.value) + 1
        if isinstance(rule, BaselineRule) and p.baseline.unit == "steps"
        else 1
    )
    k = m.rank_steps.c
    rows = conn.execute(
        select(m.rank_steps)
        .where(k.run_id == run_id, k.step <= upto, k.step > upto - back, k.rank.in_(list(ranks)))
        .order_by(k.step)
    ).mappings()
    return [dict(r) for r in rows]


def _first_step(conn: Connection, run_id: int, metric: str) -> int | None:
    s = m.step_stats.c
    first = conn.execute(
        select(s.step).where(s.run_id == run_id, s.metric == metric).order_by(s.step).limit(1)
    ).scalar()
    return int(first) if first is not None else None
