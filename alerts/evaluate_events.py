"""The record rule kinds over a snapshot: ``event`` (an instant or a stateful record
that holds now, a job lost with a hang's verdict standing), ``rate`` (how many within a
window), ``absence`` (a heartbeat, a step or an event that stopped arriving) and
``cadence`` (checkpoints far off the optimal interval).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

from .evaluate_metrics import is_finite
from .rules import (
    AbsenceRule,
    CadenceRule,
    EventKindMatch,
    EventRule,
    FlagMatch,
    JobLostMatch,
    Match,
    NonFiniteMatch,
    RankStateMatch,
    RateRule,
    ThrottleMatch,
    XidMatch,
)
from .snapshot import Row, Snapshot, Verdict, rank_detail


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
            f"{rank_detail(snap, e['rank'])} died of {data.get('signal') or 'a signal'} in "
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


def event(rule: EventRule, snap: Snapshot) -> list[Verdict]:
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
                        f"{rank_detail(snap, info.rank)} is {info.state}{role}{why}",
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
                        f"{rank_detail(snap, rank)}: GPU throttled "
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
            who = "run" if key is None else rank_detail(snap, key)
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


def absence(rule: AbsenceRule, snap: Snapshot) -> list[Verdict]:
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
                    f"{rank_detail(snap, info.rank)}: no {what} for {_ago(quiet)} "
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


def rate(rule: RateRule, snap: Snapshot) -> list[Verdict]:
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
            f"{'run' if key is None else rank_detail(snap, key)}: {n} matches within "
            f"{p.window} (at least {p.at_least})",
            snap.last_step,
        )
        for key, n in counts.items()
        if n >= p.at_least
    ]


def cadence(rule: CadenceRule, snap: Snapshot) -> list[Verdict]:
    advice = snap.cadence
    if not advice or (advice.get("checkpoints") or 0) < rule.params.min_checkpoints:
        return []
    ratio, best, now_s = (
        advice.get("ratio"),
        advice.get("optimal_interval_s"),
        advice.get("interval_s"),
    )
    if not isinstance(ratio, (int, float)) or not is_finite(ratio) or not best or not now_s:
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
