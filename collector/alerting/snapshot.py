"""What one alert pass reads of a run: the windows the loaded rules need (``needs_of``)
and the snapshot built from the database (``snapshot``), with the rank rows of settled
steps kept between passes (``recent_steps``) and the checkpoint cadence advice."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, func, or_, select

from trainwarden.alerts import Rule
from trainwarden.alerts.rules import (
    RUN_STATS,
    AbsenceRule,
    BaselineRule,
    CadenceRule,
    EventKindMatch,
    EventRule,
    FlagMatch,
    JobLostMatch,
    NonFiniteMatch,
    PeerRule,
    RankStateMatch,
    RateRule,
    ThresholdRule,
    ThrottleMatch,
    XidMatch,
)
from trainwarden.alerts.snapshot import (
    RankInfo,
    Row,
    Snapshot,
    StatRow,
    metric_columns,
)
from trainwarden.collector.read.economics import EconomicsSettings, economics
from trainwarden.collector.read.queries import arrival_lateness, median_step_time
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import fetch_rows

STATS = RUN_STATS  # the step_stats columns a run rule may read


@dataclass
class Needs:
    stats_rows: dict[str, int] = field(default_factory=dict)  # metric -> newest N rollups
    stats_s: dict[str, float] = field(default_factory=dict)  # metric -> rollups of the last S s
    first_step: bool = False
    steps_back: int = 0  # full per-rank rows over the last N steps ...
    steps_s: float = 0.0  # ... or the last S seconds (converted with the step time)
    steps_arriving: bool = False  # rows of steps not rolled up yet too (else: settled steps)
    step_cols: set[str] = field(default_factory=set)
    marked_back: int = 0  # flagged / non-finite rows over the last N steps
    marked_s: float = 0.0
    gpu_s: float = 0.0
    events_s: float = 0.0
    events_back: int = 0
    last_event: set[str] = field(default_factory=set)
    cadence: bool = False  # the checkpoint cadence advisor's verdict

    def add_stats(self, metric: str, *, rows: int = 0, seconds: float = 0.0) -> None:
        if rows:
            self.stats_rows[metric] = max(self.stats_rows.get(metric, 0), rows)
        if seconds:
            self.stats_s[metric] = max(self.stats_s.get(metric, 0.0), seconds)


def _span(needs_rows: int, needs_s: float, span: Any) -> tuple[int, float]:
    if span is None:
        return max(needs_rows, 1), needs_s
    if span.unit == "steps":
        return max(needs_rows, int(span.value)), needs_s
    return needs_rows, max(needs_s, span.value)


def needs_of(rules: Iterable[Rule], hold_s: float) -> Needs:
    n = Needs()
    for rule in rules:
        if isinstance(rule, (ThresholdRule, BaselineRule)):
            p = rule.params
            rows, secs = _span(0, 0.0, p.window)
            if isinstance(rule, BaselineRule):
                if p.baseline.unit == "steps":
                    rows += int(p.baseline.value) + (
                        int(p.warmup.value) if p.warmup.unit == "steps" else 0
                    )
                else:
                    secs += p.baseline.value
                n.first_step |= p.warmup.unit == "steps" and p.warmup.value > 0
                rows = max(rows, 1) + 1
            if p.scope == "run":
                for metric in (
                    (p.metric, "step_time")
                    if getattr(p, "fraction_of_step", False)
                    else (p.metric,)
                ):
                    n.add_stats(metric, rows=rows, seconds=secs)
            elif p.scope == "rank":
                n.steps_back, n.steps_s = max(n.steps_back, rows), max(n.steps_s, secs)
                n.steps_arriving = True
                n.step_cols |= set(metric_columns(p.metric))
            else:
                n.gpu_s = max(n.gpu_s, secs, 60.0)
        elif isinstance(rule, PeerRule):
            # The newest step every rank reported: a rolled-up one (the rollup worker rolls
            # a step up as it completes), so the rows of steps still arriving are not read.
            n.steps_back = max(n.steps_back, 8)
            n.step_cols |= set(metric_columns(rule.params.metric))
        elif isinstance(rule, EventRule):
            _match_needs(n, rule.params, steps=0, seconds=hold_s)
        elif isinstance(rule, RateRule):
            w = rule.params.window
            _match_needs(
                n,
                rule.params.count,
                steps=int(w.value) if w.unit == "steps" else 0,
                seconds=w.value if w.unit == "s" else 0.0,
            )
        elif isinstance(rule, AbsenceRule) and rule.params.event is not None:
            n.last_event.add(rule.params.event)
        elif isinstance(rule, CadenceRule):
            n.cadence = True
    return n


def _match_needs(n: Needs, match: Any, *, steps: int, seconds: float) -> None:
    if isinstance(match, (XidMatch, EventKindMatch, RankStateMatch, JobLostMatch)):
        if isinstance(match, RankStateMatch) and not steps and not seconds:
            return  # an event rule on rank states reads the ranks, not their history
        n.events_back, n.events_s = max(n.events_back, steps), max(n.events_s, seconds)
    elif isinstance(match, (FlagMatch, NonFiniteMatch)):
        n.marked_back, n.marked_s = max(n.marked_back, steps, 1), max(n.marked_s, seconds)
    elif isinstance(match, ThrottleMatch):
        n.gpu_s = max(n.gpu_s, seconds, 60.0)


def _steps_for(seconds: float, median_step_s: float | None, cap: int = 100_000) -> int:
    if not seconds:
        return 0
    if not median_step_s:
        return 1000
    return min(cap, math.ceil(seconds / median_step_s) + 2)


CADENCE_EVERY_S = 60.0
"""How often the cadence advisor is asked again about a run (it reads every checkpoint)."""


def cadence_of(
    conn: Connection,
    run: Any,
    *,
    now: float,
    settings: EconomicsSettings,
    cache: dict[int, tuple[float, dict[str, Any]]],
) -> dict[str, Any]:
    """The advisor's answer for ``run``, at most once a minute per run."""
    cached = cache.get(run.id)
    if cached is not None and now - cached[0] < CADENCE_EVERY_S:
        return cached[1]
    found = economics(conn, run.name, settings=settings, now=now)
    advice = (
        {} if found is None else {**found["advisor"], "checkpoints": found["checkpoints"]["count"]}
    )
    cache[run.id] = (now, advice)
    return advice


@dataclass
class SettledSteps:
    """One run's rank rows of steps already rolled up, kept between passes: per step,
    the rollup's stamp (rank count, time) when read, and the rows."""

    cols: tuple[str, ...]
    steps: dict[int, tuple[tuple[int, float], list[Row]]] = field(default_factory=dict)


def recent_steps(
    conn: Connection,
    run_id: int,
    *,
    since: int,
    cols: tuple[str, ...],
    cache: dict[int, SettledSteps] | None = None,
    arriving: bool = True,
) -> list[Row]:
    """The rank rows of steps after ``since``, in (step, rank) order; with ``arriving``
    false, only of the steps rolled up.

    With a ``cache``, a step already rolled up is read once and kept while its rollup
    stays the same (a late or replayed row rolls it up again, and it is read again):
    a pass reads only the steps still arriving, not the whole window of every rank
    (a rank-scoped rule's window of 20 steps at 4,096 ranks is 82,000 rows)."""
    r_, s = m.rank_steps.c, m.step_stats.c
    names = ("rank", "step", "ts", "recv_ts", *cols)
    query = select(*(r_[c] for c in names)).where(r_.run_id == run_id, r_.step > since)
    if cache is None and arriving:
        return [
            dict(zip(names, row, strict=True))
            for row in fetch_rows(conn, query.order_by(r_.step, r_.rank))
        ]
    settled = {
        row.step: (row.n, row.ts)
        for row in conn.execute(
            select(s.step, s.n, s.ts).where(
                s.run_id == run_id, s.metric == "step_time", s.step > since
            )
        )
    }
    mine = None if cache is None else cache.get(run_id)
    if mine is None or mine.cols != cols:
        mine = SettledSteps(cols)
        if cache is not None:
            cache[run_id] = mine
    mine.steps = {st: kept for st, kept in mine.steps.items() if settled.get(st) == kept[0]}
    fetched: dict[int, list[Row]] = {}
    wanted = None if arriving else sorted(settled.keys() - mine.steps.keys())
    if wanted is not None:
        query = query.where(r_.step.in_(wanted))
    elif mine.steps:
        query = query.where(r_.step.not_in(sorted(mine.steps)))
    rows = [] if wanted == [] else fetch_rows(conn, query.order_by(r_.step, r_.rank))
    for row in rows:
        fetched.setdefault(row[1], []).append(dict(zip(names, row, strict=True)))
    for st, rows in fetched.items():
        if st in settled:
            mine.steps[st] = (settled[st], rows)
    out: list[Row] = []
    for st in sorted(mine.steps.keys() | fetched.keys()):
        out += mine.steps[st][1] if st in mine.steps else fetched[st]
    return out


def snapshot(
    conn: Connection,
    run: Any,
    needs: Needs,
    *,
    now: float,
    lag_s: float,
    hold_s: float,
    first_steps: dict[int, int],
    cadence: Callable[[], dict[str, Any]] | None = None,
    step_cache: dict[int, SettledSteps] | None = None,
    pressed: bool = False,
    heard: Mapping[int, float] | None = None,
) -> Snapshot:
    """One run's recent records, as much as ``needs`` says; ``step_cache`` keeps the
    rank rows of rolled-up steps between passes (:func:`recent_steps`).

    As the health evaluator does: ``pressed`` (the collector fell behind lately) widens
    ``lag_s`` to how late the run's ranks have been arriving, and ``heard`` (ranks whose
    requests the collector refused, and when) counts as their heartbeat, so that an
    absence rule (RankDead) does not page for a busy collector."""
    run_id, last = run.id, run.last_step
    if pressed:
        lag_s = max(lag_s, arrival_lateness(conn, run_id))
    heard = heard or {}
    t = m.attempts.c
    snap = Snapshot(
        run=run.name,
        now=now,
        last_step=last,
        started_at=run.created_at,
        attempt_started_at=conn.execute(
            select(func.max(t.started_at)).where(t.run_id == run_id)
        ).scalar(),
        lag_s=lag_s,
        hold_s=hold_s,
    )
    k = m.ranks.c
    # Every rank, every pass: the two JSON fields are read in SQL (not parsed a row here),
    # and rows are unpacked as tuples (at 16,384 ranks: 230 -> 150 ms a pass).
    rows = fetch_rows(
        conn,
        select(
            k.rank,
            k.node,
            k.gpu["uuid"].as_string(),
            k.gpu["state"].as_string(),
            k.local_rank,
            k.state,
            k.state_detail["role"].as_string(),
            k.state_detail["collective"].as_string(),
            k.last_seen,
            k.heartbeat_s,
            k.progress_at,
            k.last_step,
            k.state_since,
            k.state_detail["since"].as_float(),
            k.state_detail["ended"].as_string(),
        ).where(k.run_id == run_id),
    )
    for row in rows:
        rank, node, gpu, gpu_state, local_rank, state, role, coll, seen, beat = row[:10]
        # A rank without a GPU (CPU-only, telemetry off) is named by its rank alone: its
        # local rank is no GPU's index.
        has_gpu = gpu_state not in ("unavailable", "off")
        snap.ranks[rank] = RankInfo(
            rank=rank,
            node=node,
            gpu=gpu or (str(local_rank) if local_rank is not None and has_gpu else None),
            state=state,
            role=role,
            collective=coll,
            last_seen=max(seen, heard.get(rank, seen)),
            heartbeat_s=beat,
            progress_at=row[10],
            last_step=row[11],
            state_since=row[12],
            hung_since=row[13],
            ended=row[14],
        )
    # The run row's last step is refreshed every few seconds; the ranks' are current.
    newest = max(
        (r.last_step for r in snap.ranks.values() if r.last_step is not None), default=None
    )
    if newest is not None and (last is None or newest > last):
        snap.last_step = last = newest
    snap.median_step_s = median_step_time(conn, run_id)
    s = m.step_stats.c
    for metric in set(needs.stats_rows) | set(needs.stats_s):
        query = select(s.step, s.ts, *(s[c] for c in STATS)).where(
            s.run_id == run_id, s.metric == metric
        )
        rows_n = needs.stats_rows.get(metric, 0)
        secs = needs.stats_s.get(metric, 0.0)
        if secs:
            query = query.where(s.ts > now - secs)
        if rows_n and not secs:
            query = query.limit(rows_n)
        stats = conn.execute(query.order_by(s.step.desc())).all()
        snap.stats[metric] = [
            StatRow(r.step, r.ts, {c: getattr(r, c) for c in STATS}) for r in reversed(stats)
        ]
    if needs.first_step:
        if run_id not in first_steps:
            first = conn.execute(
                select(func.min(s.step)).where(s.run_id == run_id, s.metric == "step_time")
            ).scalar()
            if first is not None:
                first_steps[run_id] = first
        snap.first_step = first_steps.get(run_id)
    r_ = m.rank_steps.c
    if last is not None:
        back = max(needs.steps_back, _steps_for(needs.steps_s, snap.median_step_s))
        if back:
            cols = tuple(sorted(needs.step_cols | {"duration_s"}))
            snap.steps = recent_steps(
                conn,
                run_id,
                since=last - back,
                cols=cols,
                cache=step_cache,
                arriving=needs.steps_arriving,
            )
        back = max(needs.marked_back, _steps_for(needs.marked_s, snap.median_step_s))
        if back:
            snap.marked = [
                dict(row)
                for row in conn.execute(
                    select(r_.rank, r_.step, r_.ts, r_.recv_ts, r_.flags, r_.issues)
                    .where(
                        r_.run_id == run_id,
                        r_.step > last - max(back, 50),
                        or_(r_.flags.is_not(None), r_.issues.is_not(None)),
                    )
                    .order_by(r_.step, r_.rank)
                ).mappings()
            ]
    if needs.gpu_s and snap.ranks:
        g = m.gpu_samples.c
        snap.gpu = [
            dict(row)
            for row in conn.execute(
                select(m.gpu_samples)
                .where(g.run_id == run_id, g.ts > now - needs.gpu_s)
                .order_by(g.ts)
            ).mappings()
        ]
    events_s = max(
        needs.events_s,
        (needs.events_back * (snap.median_step_s or 1.0) * 2) if needs.events_back else 0.0,
    )
    if events_s:
        e = m.events.c
        snap.events = [
            dict(row)
            for row in conn.execute(
                select(e.id, e.rank, e.step, e.ts, e.recv_ts, e.kind, e.data)
                .where(e.run_id == run_id, e.ts > now - events_s)
                .order_by(e.ts)
            ).mappings()
        ]
    for kind in needs.last_event:
        e = m.events.c
        ts = conn.execute(select(func.max(e.ts)).where(e.run_id == run_id, e.kind == kind)).scalar()
        if ts is not None:
            snap.last_event[kind] = ts
    if needs.cadence and cadence is not None:
        snap.cadence = cadence()
    return snap
