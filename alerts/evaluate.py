"""Each rule kind over a snapshot of one run's recent records: which alerts are active now.

The engine (``collector/alerting/engine.py``) fetches a :class:`Snapshot` per run and pass
from the database, with the windows the loaded rules need; tests build snapshots by
hand. ``evaluate(rule, snapshot)`` returns a :class:`Verdict` for every run (rank-less)
or rank on which the rule's condition holds now; everything not returned is inactive.
The lifecycle (``for``, ``keep_firing_for``) is applied afterwards, by ``lifecycle.advance``.

Instants (an XID, a spike flag, a NaN, an event) hold for ``hold_s`` after the record
*arrived*, long enough for the next pass to see them whatever the ingest lag; the
alert then resolves after the rule's ``keep_firing_for``.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from trainwarden.alerts.metrics import METRICS

from .intervals import Interval
from .rules import (
    AbsenceRule,
    BaselineRule,
    CadenceRule,
    EventKindMatch,
    EventRule,
    FlagMatch,
    JobLostMatch,
    Match,
    NonFiniteMatch,
    PeerRule,
    RankStateMatch,
    RateRule,
    Rule,
    ThresholdRule,
    ThrottleMatch,
    XidMatch,
)

LIVE_STATES = ("healthy", "slow", "hung", "dead", "running")
"""Rank states that still belong to the job (``finished`` and ``failed`` ranks said goodbye)."""
Row = Mapping[str, Any]

# The rank_steps columns each per-rank metric is computed from (rollups.METRICS).
_DERIVED = {
    "tokens_per_s": ("tokens", "duration_s"),
    "exposed_comm_frac": ("exposed_comm_s", "duration_s"),
}


def metric_columns(metric: str) -> tuple[str, ...]:
    """The ``rank_steps`` columns needed to compute ``metric`` per rank."""
    source = METRICS[metric].source
    return (source, "duration_s") if source else _DERIVED[metric]


@dataclass(frozen=True)
class RankInfo:
    rank: int
    node: str | None = None
    gpu: str | None = None
    state: str = "healthy"
    role: str | None = None  # culprit | victim, for hung ranks
    collective: str | None = None  # the hung-collective verdict (Flight Recorder), if any
    last_seen: float | None = None
    heartbeat_s: float | None = None
    progress_at: float | None = None
    last_step: int | None = None
    state_since: float | None = None
    hung_since: float | None = None  # when the hang the verdict names began
    ended: str | None = None  # how a rank in a verdict ended: its attempt_end reason


@dataclass(frozen=True)
class StatRow:
    """One run step's rollup of a metric (``step_stats``): stat name -> value."""

    step: int
    ts: float
    values: Mapping[str, float | None]


@dataclass
class Snapshot:
    """What one pass knows of one run. Lists are in time (or step) order."""

    run: str
    now: float
    last_step: int | None = None
    first_step: int | None = None  # the run's first rolled-up step (for warm-up)
    started_at: float | None = None
    attempt_started_at: float | None = None  # the current attempt's (a restart's) start
    ranks: dict[int, RankInfo] = field(default_factory=dict)
    stats: dict[str, list[StatRow]] = field(default_factory=dict)
    steps: list[Row] = field(default_factory=list)  # recent rank_steps rows
    marked: list[Row] = field(default_factory=list)  # rank_steps rows with flags or issues
    gpu: list[Row] = field(default_factory=list)  # recent gpu_samples rows
    events: list[Row] = field(
        default_factory=list
    )  # recent events (kind, rank, step, ts, recv_ts, data)
    last_event: dict[str, float] = field(default_factory=dict)  # kind -> newest ts ever
    median_step_s: float | None = None
    cadence: Mapping[str, Any] | None = None  # the cadence advisor's, when a rule asks
    lag_s: float = 0.0  # the collector's own ingest lag, allowed for by absence rules
    hold_s: float = 10.0

    def live(self) -> list[RankInfo]:
        return [r for r in self.ranks.values() if r.state in LIVE_STATES]

    def by_step(self) -> dict[int, dict[int, Row]]:
        """``steps`` grouped as {step: {rank: row}}, built once a snapshot (peer rules
        each look for the newest complete step among every rank's recent rows)."""
        key = (id(self.steps), len(self.steps))
        if self._by_step is None or self._by_step[0] != key:
            grouped: dict[int, dict[int, Row]] = defaultdict(dict)
            for row in self.steps:
                grouped[row["step"]][row["rank"]] = row
            self._by_step = (key, grouped)
        return self._by_step[1]

    _by_step: tuple[tuple[int, int], dict[int, dict[int, Row]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )


@dataclass(frozen=True)
class Verdict:
    """The condition holds: for the whole run (``rank`` None) or for one rank."""

    rank: int | None
    value: float | None
    detail: str
    step: int | None = None
    onset_step: int | None = None
    """The first step of the streak in which the condition holds, from the data (a
    baseline or threshold rule), or the earliest matching record's own step (an event
    rule): where the anomaly began, not when a pass noticed it. ``None``: not known."""
    annotations: dict[str, str] | None = None
    """Annotations of this verdict's own, beside summary / description / runbook_url
    (``RankHung``, and ``RankDead`` for a dead culprit: ``collective``, the verdict on the
    ranks' Flight Recorder rings; an event rule whose events say ``clean_through``
    (``replica_divergence``): the newest step whose checkpoint is known clean, which a
    rollback restores exactly)."""


# -- helpers ----------------------------------------------------------------------


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _median(values: Iterable[float]) -> float | None:
    finite = [v for v in values if _finite(v)]
    return statistics.median(finite) if finite else None


def _rank_value(metric: str, row: Row) -> float | None:
    value = METRICS[metric].value(row)
    return float(value) if _finite(value) else None


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


def _rank_detail(snap: Snapshot, rank: int) -> str:
    info = snap.ranks.get(rank)
    return f"rank {rank}" + (f" (node {info.node})" if info and info.node else "")


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def _fresh(row: Row, snap: Snapshot) -> bool:
    """An instant that arrived recently enough to count as happening now, and happened in
    the run's current attempt: one of an attempt that ended (the job restarted since) spoke
    of processes that are gone, and a rank of the new attempt may run on another node; its
    alert, if it fired, was dealt with in its time (it must not open a second episode, and
    act again, once the job is back: seen in the Slurm SDC drill, which evicted the rank's
    new node)."""
    if snap.attempt_started_at is not None:
        # When it happened: an event may say (a replica check decided late: its step's time)
        data = row.get("data")
        at = data.get("ran_at") if isinstance(data, dict) else None
        if (at if isinstance(at, (int, float)) else row.get("ts", snap.now)) < (
            snap.attempt_started_at
        ):
            return False
    return row["recv_ts"] > snap.now - snap.hold_s


# -- kinds --------------------------------------------------------------------------


def _threshold(rule: ThresholdRule, snap: Snapshot) -> list[Verdict]:
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
            who = "run" if rank is None else _rank_detail(snap, rank)
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
                    if _finite(value) and _finite(step_time) and step_time
                    else None
                )
            if _finite(value):
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
            if _finite(row.get(metric)):
                out[row["rank"]].append((0, row["ts"], float(row[metric])))
    return out


def _baseline(rule: BaselineRule, snap: Snapshot) -> list[Verdict]:
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
            who = "run" if rank is None else _rank_detail(snap, rank)
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


def _peer(rule: PeerRule, snap: Snapshot) -> list[Verdict]:
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
                        f"{_rank_detail(snap, rank)}: {p.metric} {_fmt(value)} is {z:+.1f} robust "
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
                    f"{_rank_detail(snap, rank)}: {p.metric} {_fmt(value)} is {ratio:.2f}x "
                    f"its peers' median {_fmt(others)} at step {step}",
                    step,
                )
            )
    return out


def _matches(match: Match, snap: Snapshot) -> list[tuple[Row, int | None, str]]:
    """The records that match, as (record, rank, what) — instants and stateful alike,
    over everything in the snapshot (callers narrow by time or step)."""
    out: list[tuple[Row, int | None, str]] = []
    if isinstance(match, XidMatch):
        for e in snap.events:
            code = (e.get("data") or {}).get("code")
            if e["kind"] == "xid" and isinstance(code, int) and match.matches(code):
                meaning = (
                    (e.get("data") or {}).get("name")
                    or (e.get("data") or {}).get("description")
                    or ""
                )
                out.append((e, e.get("rank"), f"XID {code}" + (f" ({meaning})" if meaning else "")))
    elif isinstance(match, FlagMatch):
        for row in snap.marked:
            hit = sorted(set(row.get("flags") or ()) & set(match.flags))
            if hit:
                out.append((row, row["rank"], f"{', '.join(hit)} at step {row['step']}"))
    elif isinstance(match, NonFiniteMatch):
        for row in snap.marked:
            issues = row.get("issues") or {}
            hit = [f"{name} = {issues[name]}" for name in match.metrics if name in issues]
            if hit:
                out.append((row, row["rank"], f"{', '.join(hit)} at step {row['step']}"))
    elif isinstance(match, EventKindMatch):
        for e in snap.events:
            if e["kind"] in match.events:
                # The rank it came from: an event rule is per run anyway (EventRule.per_rank),
                # but a rate rule counting per rank counts each rank's own.
                why = (e.get("data") or {}).get("reason")
                out.append(
                    (
                        e,
                        e.get("rank"),
                        f"event {e['kind']}"
                        + (f" on rank {e['rank']}" if e.get("rank") is not None else "")
                        + (f": {why}" if isinstance(why, str) and why else ""),
                    )
                )
    elif isinstance(match, RankStateMatch):  # in a rate rule: the state changes, as events
        for e in snap.events:
            data = e.get("data") or {}
            if (
                e["kind"] == "rank_state"
                and data.get("to") in match.to
                and (match.role is None or data.get("role") == match.role)
            ):
                out.append((e, e.get("rank"), f"became {data.get('to')}"))
    elif isinstance(match, ThrottleMatch):
        for row in snap.gpu:
            hit = sorted(set(row.get("throttle") or ()) & set(match.reasons))
            if hit:
                out.append((row, row["rank"], f"throttled: {', '.join(hit)}"))
    return out


_ENDINGS = {
    "sigterm": "torn down (SIGTERM)",
    "stopped": "stopped by trainwarden",
    "exception": "ended on an exception",
    "completed": "ended",
}


def _job_lost(match: JobLostMatch, snap: Snapshot) -> list[Verdict]:
    """The run's job died with a verdict standing (:class:`JobLostMatch`): one verdict
    for the run, the culprit's collective verdict and how the job ended."""
    placed = [r for r in snap.ranks.values() if r.collective and r.role in ("culprit", "victim")]
    gone = {}
    for r in placed:
        if r.state in ("finished", "failed"):
            gone[r.rank] = (r.state_since or snap.now, _ENDINGS.get(r.ended or "", "ended"))
        elif r.last_seen is not None:
            silent = snap.now - r.last_seen
            if silent > match.after_beats * (r.heartbeat_s or 2.0) + snap.lag_s:
                gone[r.rank] = (r.last_seen, "killed (its ranks went silent, no goodbye)")
    if gone:
        lead = min(placed, key=lambda r: (r.role != "culprit", r.rank))
        ended_at, how = min(gone.values())
        began = min((r.hung_since for r in placed if r.hung_since), default=None)
        later = f" {max(0.0, ended_at - began):.0f} s later" if began else ""
        return [
            Verdict(
                None,
                float(len(gone)),
                f"{lead.collective}; the job was {how}{later}",
                snap.last_step,
                annotations={
                    "collective": lead.collective or "",
                    "culprits": ",".join(str(r.rank) for r in placed if r.role == "culprit"),
                },
            )
        ]
    for e in snap.events:  # a rank died of a signal inside a collective: its last words
        data = e.get("data") or {}
        if e["kind"] != "rank_crashed" or e.get("rank") is None or not data.get("collective"):
            continue
        if snap.attempt_started_at is not None and e["ts"] < snap.attempt_started_at:
            continue
        cause = str(data.get("cause") or data.get("cause_note") or "")[:400]
        said = (
            f"{_rank_detail(snap, e['rank'])} died of {data.get('signal') or 'a signal'} in "
            f"{data['collective']}" + (f" ({data['where']})" if data.get("where") else "")
        )
        return [
            Verdict(
                None,
                1.0,
                f"{said}: {cause}" if cause else said,
                e.get("step"),
                annotations={"collective": said, "culprits": str(e["rank"])},
            )
        ]
    return []


def _event(rule: EventRule, snap: Snapshot) -> list[Verdict]:
    match = rule.params
    if isinstance(match, JobLostMatch):
        return _job_lost(match, snap)
    if isinstance(match, RankStateMatch):
        out = []
        for info in snap.ranks.values():
            if info.state in match.to and (match.role is None or info.role == match.role):
                role = f" ({info.role})" if info.role else ""
                why = f": {info.collective}" if info.collective else ""
                out.append(
                    Verdict(
                        info.rank,
                        None,
                        f"{_rank_detail(snap, info.rank)} is {info.state}{role}{why}",
                        info.last_step,
                        annotations={"collective": info.collective} if info.collective else None,
                    )
                )
        return out
    if isinstance(match, ThrottleMatch):  # the newest sample of each rank
        latest: dict[int, Row] = {}
        for row in snap.gpu:
            latest[row["rank"]] = row
        out = []
        for rank, row in latest.items():
            hit = sorted(set(row.get("throttle") or ()) & set(match.reasons))
            if hit:
                out.append(
                    Verdict(
                        rank,
                        row.get("temp_c"),
                        f"{_rank_detail(snap, rank)}: GPU throttled "
                        f"({', '.join(hit)}) at {row.get('temp_c')} °C",
                        snap.last_step,
                    )
                )
        return out
    found: dict[int | None, Verdict] = {}
    first: dict[int | None, int] = {}  # the earliest matching step: the onset
    clean: dict[int | None, int] = {}  # the oldest clean_through an event said
    for row, who_rank, what in _matches(match, snap):
        if _fresh(row, snap):
            key = who_rank if rule.per_rank else None
            who = "run" if key is None else _rank_detail(snap, key)
            step = row.get("step")
            if step is not None:
                first[key] = min(first.get(key, step), step)
            through = (row.get("data") or {}).get("clean_through")
            if isinstance(through, int):
                clean[key] = min(clean.get(key, through), through)
            found[key] = Verdict(key, None, f"{who}: {what}", step)  # the newest wins
    return [
        replace(
            v,
            onset_step=first.get(key),
            annotations={"clean_through": str(clean[key])} if key in clean else None,
        )
        for key, v in found.items()
    ]


def _absence(rule: AbsenceRule, snap: Snapshot) -> list[Verdict]:
    p = rule.params
    live = snap.live()
    if p.signal == "event":
        if not live:
            return []
        assert p.event is not None
        last = snap.last_event.get(p.event, snap.started_at)
        if last is None or last >= snap.now - p.after.value - snap.lag_s:
            return []
        since = (
            "since the run started"
            if p.event not in snap.last_event
            else f"for {_ago(snap.now - last)}"
        )
        return [
            Verdict(
                None,
                snap.now - last,
                f"run: no {p.event} event {since} (expected within {p.after})",
                snap.last_step,
            )
        ]
    out = []
    for info in live:
        if p.signal == "heartbeat":
            seen = info.last_seen
            per = info.heartbeat_s or 2.0
        else:
            seen = info.progress_at if info.progress_at is not None else info.last_seen
            per = snap.median_step_s or 0.0
        if seen is None:
            continue
        after = p.after.value if p.after.unit == "s" else p.after.value * per
        if p.at_least is not None:
            after = max(after, p.at_least.value)
        if after <= 0:
            continue  # no step time known yet to count steps by
        quiet = snap.now - seen
        # The collector's lag is allowed for, except for a rank the health pass declared
        # dead and has not heard from since: a lag that grew does not bring it back.
        unheard = info.state == "dead" and seen <= (info.state_since or 0.0)
        if quiet > after + (0.0 if unheard and p.signal == "heartbeat" else snap.lag_s):
            what = "heartbeat" if p.signal == "heartbeat" else "completed step"
            # A dead rank the survivors' rings name the culprit (``RankDead``): the verdict;
            # a dead victim says whose victim it was.
            coll = info.collective if p.signal == "heartbeat" else None
            said = ""
            if coll:
                said = f" (a victim of: {coll})" if info.role == "victim" else f": {coll}"
                coll = None if info.role == "victim" else coll
            out.append(
                Verdict(
                    info.rank,
                    quiet,
                    f"{_rank_detail(snap, info.rank)}: no {what} for {_ago(quiet)} "
                    f"(allowed {p.after}, {after:.1f}s)" + said,
                    info.last_step,
                    annotations={"collective": coll} if coll else None,
                )
            )
    return out


def _ago(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 60:.1f}m" if seconds >= 120 else f"{seconds:.1f}s"


def _rate(rule: RateRule, snap: Snapshot) -> list[Verdict]:
    p = rule.params
    if p.window.unit == "steps":
        lo = (snap.last_step or 0) - p.window.value

        def inside(row: Row) -> bool:
            return row.get("step") is not None and row["step"] > lo
    else:

        def inside(row: Row) -> bool:
            return row["ts"] > snap.now - p.window.value

    counts: dict[int | None, int] = defaultdict(int)
    seen: set[tuple[int | None, Any]] = set()
    for row, rank, _ in _matches(p.count, snap):
        if not inside(row):
            continue
        key = rank if p.per == "rank" else None
        # Per run, a flag every rank raises at one step (a global grad norm) is one spike.
        # Events are each one: XIDs from a stuck job all carry the same last step.
        per_step = p.per == "run" and isinstance(p.count, (FlagMatch, NonFiniteMatch))
        ident = (key, row["step"] if per_step else id(row))
        if ident in seen:
            continue
        seen.add(ident)
        counts[key] += 1
    return [
        Verdict(
            key,
            float(n),
            f"{'run' if key is None else _rank_detail(snap, key)}: {n} matches within "
            f"{p.window} (at least {p.at_least})",
            snap.last_step,
        )
        for key, n in counts.items()
        if n >= p.at_least
    ]


def _cadence(rule: CadenceRule, snap: Snapshot) -> list[Verdict]:
    advice = snap.cadence
    if not advice or (advice.get("checkpoints") or 0) < rule.params.min_checkpoints:
        return []
    ratio, best, now_s = (
        advice.get("ratio"),
        advice.get("optimal_interval_s"),
        advice.get("interval_s"),
    )
    if not isinstance(ratio, (int, float)) or not _finite(ratio) or not best or not now_s:
        return []
    off = rule.params.off_by
    if 1 / off <= ratio <= off:
        return []
    waste_now, waste_best = advice.get("waste_now"), advice.get("waste_optimal")
    if (
        isinstance(waste_now, (int, float))
        and isinstance(waste_best, (int, float))
        and waste_now - waste_best < rule.params.min_saving
    ):
        return []  # far off T*, but following it would gain next to nothing
    do = "save more often" if ratio > 1 else "save less often"
    detail = (
        f"run: checkpoints every {_ago(now_s)}; the optimum T* = sqrt(2 C tau) is "
        f"{_ago(best)} (C {advice.get('cost_s', 0):.1f} s, tau {_ago(advice.get('mtbf_s') or 0)}): "
        f"{do}; expected waste {100 * (advice.get('waste_now') or 0):.1f}% vs "
        f"{100 * (advice.get('waste_optimal') or 0):.1f}% at T*"
    )
    return [Verdict(None, float(ratio), detail, snap.last_step)]


_KINDS: dict[type, Callable[[Any, Snapshot], list[Verdict]]] = {
    ThresholdRule: _threshold,
    BaselineRule: _baseline,
    PeerRule: _peer,
    EventRule: _event,
    AbsenceRule: _absence,
    RateRule: _rate,
    CadenceRule: _cadence,
}


def evaluate(rule: Rule, snap: Snapshot) -> list[Verdict]:
    """The runs / ranks on which ``rule``'s condition holds in ``snap``."""
    return _KINDS[type(rule)](rule, snap)


def median_without(values: list[float], i: int) -> float:
    """The median of sorted ``values`` without the element at index ``i``, in O(1)."""
    n = len(values) - 1

    def at(k: int) -> float:  # the k-th element once index i is removed
        return values[k if k < i else k + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2
