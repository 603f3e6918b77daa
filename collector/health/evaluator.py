"""Rank health: which ranks are healthy, slow, hung or dead, and who is to blame.

``evaluate`` runs about once a second (a thread in ``serve``), reads each live run's
ranks and recent steps, and writes state changes (with an event each) back. Rules:

- **dead**: no heartbeat for ``dead_after_beats`` (2.25) x the rank's heartbeat interval;
  when the rank died of a signal and a survivor of its node sent its last words
  (``rank_crashed``, :mod:`..ingest.crashes`), the detail's reason is what it died of;
- **hung**: heartbeats arrive but no step has completed for ``max(hung_min_s,
  hung_steps x the run's median step time)``. When several ranks stall together the
  culprits are the ranks furthest behind (lowest last step, then earliest phase), or
  the dead ranks; the others are *victims* blocked in a collective, and say so;
- **slow** (straggler): the rank's compute time exceeds ``straggler_ratio`` x the
  median of its peers' on each of the last ``straggler_window`` complete steps. A rank
  whose exposed communication is long while its compute is normal is a victim of the
  straggler, not a culprit: its detail says which rank it waits on;
- **loss divergence** (not a state: an event and a detail): the rank's loss leaves its
  peers' band, robust z-score over the ranks of the same step, on
  ``divergence_window`` consecutive steps; needs at least 3 ranks;
- **replica divergence** (an event): a rank's parameter fingerprint differs from its
  replica group's majority on a checked step (:mod:`.replicas`).

A busy collector is not a dead rank. The dead threshold grows by how late the collector
is: its own delay (requests waiting to be read or written) or, when it fell behind
lately (``limits.Pressure``) and that is larger, how much later than their heartbeat the
run's ranks have been arriving. A rank declared dead stays dead until it is heard from
again: a threshold that grew since does not bring it back. A request it refused with
503 still counts as its ranks' heartbeat (the agent names them in a header). Hung is
judged from what the rank itself said in its latest request: how long it had gone
without a step when it sent it, by its own clock; a request kept waiting, or a node
whose clock is off, changes nothing.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, false, func, or_, select, text, update

from trainwarden.alerts.evaluate_metrics import median_without
from trainwarden.alerts.snapshot import LIVE_STATES
from trainwarden.collector.health import coverage, hang, mixture, replicas, samples
from trainwarden.collector.ingest import crashes, endings
from trainwarden.collector.ingest.limits import Pressure
from trainwarden.collector.loops import Loop
from trainwarden.collector.read.queries import arrival_lateness
from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import dialect_insert
from trainwarden.collector.store.db import fetch_rows, is_sqlite, write

log = logging.getLogger(__name__)

PHASE_ORDER = {None: 0, "step": 0, "forward": 1, "backward": 2, "optimizer": 3, "other": 4}
ADVISORY_LOCK_KEY = 0x7477_6865_616C  # "twheal": one evaluator across collectors
LIVE = LIVE_STATES


@dataclass(frozen=True)
class HealthSettings:
    dead_after_beats: float = 2.25
    hung_min_s: float = 5.0
    hung_steps: float = 5.0
    straggler_ratio: float = 1.2
    straggler_window: int = 5
    divergence_z: float = 6.0
    divergence_window: int = 5
    interval_s: float = 1.0
    max_cpu_share: float = 0.15  # of one core; past it evaluations are spaced out (Loop)


def _median_step_time(conn: Connection, run_id: int) -> float | None:
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


def _recent_views(conn: Connection, run_id: int, world: int, count: int) -> dict[int, StepView]:
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


def _events(conn: Connection, *, run_id: int, now: float, events: list[dict[str, Any]]) -> None:
    """Insert events in one statement; ``uid`` makes each idempotent."""
    if events:
        conn.execute(
            dialect_insert(conn, m.events).on_conflict_do_nothing(index_elements=["uid"]),
            [
                {
                    **e,
                    "uid": uuid.uuid5(uuid.NAMESPACE_OID, e["uid"]).hex,
                    "run_id": run_id,
                    "ts": now,
                    "recv_ts": now,
                }
                for e in events
            ],
        )


PLACE_ENDED_S = 120.0
"""How long after its goodbye a rank that ended hung, with no verdict yet, waits for one."""


def _place_ended(conn: Connection, *, now: float) -> int:
    """Ranks that said goodbye while hung before a verdict was stored (a job torn down
    within a pass of its hang: endings.goodbye marks them ``hung_at_end``): decide the
    verdict on their rings as for hung ranks (:func:`hang.refine`), give each its place in
    it, store the verdict, and settle the run's status (an ended hang is ``failed``).
    Returns the ranks placed."""
    k = m.ranks.c
    # Only the ranks of runs touched lately (a goodbye touches its run): the runs table
    # is small, the ranks table may hold a hundred thousand rows.
    recent = select(m.runs.c.id).where(m.runs.c.updated_at >= now - PLACE_ENDED_S)
    ended = conn.execute(
        select(k.run_id, k.rank, k.state_detail, k.last_step)
        .where(
            k.run_id.in_(recent.scalar_subquery()),
            k.state == "failed",
            k.state_since >= now - PLACE_ENDED_S,
        )
        .order_by(k.run_id, k.rank)
    ).all()
    waiting: dict[int, list[Any]] = defaultdict(list)
    for row in ended:
        detail = row.state_detail or {}
        if detail.get("hung_at_end") and not detail.get("role"):
            waiting[row.run_id].append(row)
    placed = 0
    for run_id, rows in waiting.items():
        world = conn.execute(select(m.runs.c.world_size).where(m.runs.c.id == run_id)).scalar()
        states = {r.rank: ("hung", dict(r.state_detail)) for r in rows}
        as_hung = [
            {
                "rank": r.rank,
                "state": "hung",
                "state_since": r.state_detail.get("hung_since"),
                "last_step": r.last_step,
            }
            for r in rows
        ]
        dead = list(
            conn.execute(select(k.rank).where(k.run_id == run_id, k.state == "dead")).scalars()
        )
        events = hang.refine(
            conn,
            run_id=run_id,
            world=world or len(rows),
            ranks=as_hung,
            states=states,
            dead=dead,
            now=now,
        )
        for r in rows:
            verdict_detail = states[r.rank][1]
            if verdict_detail.get("role") not in ("culprit", "victim"):
                continue  # no verdict yet (no rings): again next pass, within the window
            conn.execute(
                update(m.ranks)
                .where(k.run_id == run_id, k.rank == r.rank)
                .values(state_detail=endings.placed_at_end(r.state_detail, verdict_detail))
            )
            placed += 1
        _events(conn, run_id=run_id, now=now, events=events)
        endings.settle_run(conn, run_id)
    return placed


def _idle_s(rank: Any, *, now: float, late: float, refused_at: float | None) -> float:
    """How long the rank has gone without completing a step, at the least.

    What it said: how long it had gone without one when it sent its latest request, by
    its own clock (``progress_at`` and ``sent_at`` both are the agent's: no skew between
    clocks, no time the request spent in transit or in a queue). Plus the time since,
    less ``late`` (news of a step may be on its way); not when a later request of the
    rank was refused (it may have carried that news)."""
    sent_at = rank["last_seen"] - (rank["clock_skew_s"] or 0.0)
    said = sent_at - rank["progress_at"]
    if refused_at is not None and refused_at > rank["last_seen"]:
        return said
    return said + max(0.0, now - rank["last_seen"] - late)


def dead_detail(
    rank: Any, now: float, places: Callable[[], Mapping[int, Mapping[str, Any]]] | None = None
) -> dict[str, Any]:
    """A rank found dead. A rank that was in a hang's verdict keeps its place in it (the
    verdict, not the order in which heartbeats stopped, says who is the culprit: a victim
    that dies is a dead victim); so does one the standing verdict names whose state had
    moved on (``places``: :func:`endings.standing_places`, asked only then); any other
    rank that dies is a culprit."""
    silent = f"no heartbeat for {now - rank['last_seen']:.1f}s"
    before = rank["state_detail"] or {}
    if not (rank["state"] in ("hung", "dead") and before.get("role") in ("culprit", "victim")):
        placed = places().get(rank["rank"]) if places is not None else None
        before = dict(placed) if placed is not None else {}
    if before.get("role") in ("culprit", "victim"):
        kept = {key: before[key] for key in endings.VERDICT_KEYS if key in before}
        if kept["role"] == "victim":
            return {**kept, "reason": f"{silent}; was waiting on rank(s) {kept.get('waiting_on')}"}
        return {**kept, "reason": silent}
    return {"role": "culprit", "reason": silent}


def _states(
    ranks: list[Any],
    *,
    now: float,
    settings: HealthSettings,
    median_step: float | None,
    slow: dict[int, float],
    steps: dict[int, StepView],
    lag_s: float = 0.0,
    heard: Mapping[int, float] | None = None,
    still_dead: Callable[[], list[int]] | None = None,
    places: Callable[[], Mapping[int, Mapping[str, Any]]] | None = None,
) -> dict[int, tuple[str, dict[str, Any]]]:
    """The state and detail of every live rank. ``lag_s``: how late the collector hears
    from ranks; silence that long is the collector's, not the rank's. ``heard``: when a
    rank last sent a request the collector refused (as alive as one it took).
    ``still_dead``: the dead ranks not in ``ranks`` (not heard from since), asked for
    only when hung ranks may be waiting on them. ``places``: where the standing verdict
    places the ranks, asked only for a rank found dead whose own state no longer says."""
    hung_after = max(settings.hung_min_s, settings.hung_steps * (median_step or 0.0))
    heard = heard or {}
    dead, stalled = [], []
    for r in ranks:
        beat = r["heartbeat_s"] or 2.0
        seen = max(r["last_seen"], heard.get(r["rank"], r["last_seen"]))
        if now - seen > settings.dead_after_beats * beat + lag_s or _unheard_since_death(r, seen):
            dead.append(r)
        elif (
            r["progress_at"] is not None
            and _idle_s(r, now=now, late=lag_s, refused_at=heard.get(r["rank"])) > hung_after
        ):
            stalled.append(r)
    out: dict[int, tuple[str, dict[str, Any]]] = {}
    for r in dead:
        out[r["rank"]] = ("dead", dead_detail(r, now, places))
    if stalled:
        blamed_dead = sorted(
            {r["rank"] for r in dead if out[r["rank"]][1]["role"] == "culprit"}
            | set(still_dead() if still_dead else ())
        )
        if blamed_dead:
            culprits: list[Any] = []
        else:
            key = min(
                (
                    r["last_step"] if r["last_step"] is not None else -1,
                    PHASE_ORDER.get(r["phase"], 5),
                )
                for r in stalled
            )
            culprits = [
                r
                for r in stalled
                if (
                    r["last_step"] if r["last_step"] is not None else -1,
                    PHASE_ORDER.get(r["phase"], 5),
                )
                == key
            ]
        blamed = blamed_dead or sorted(r["rank"] for r in culprits)
        for r in stalled:
            idle = _idle_s(r, now=now, late=lag_s, refused_at=heard.get(r["rank"]))
            detail: dict[str, Any]
            if r in culprits:
                detail = {
                    "role": "culprit",
                    "reason": f"no step completed for {idle:.1f}s (in "
                    f"{r['phase'] or 'between steps'})",
                }
            else:
                detail = {
                    "role": "victim",
                    "waiting_on": blamed,
                    "reason": f"blocked for {idle:.1f}s in {r['phase'] or 'a step'}, waiting "
                    f"on rank(s) {blamed}",
                }
            out[r["rank"]] = ("hung", detail)
    exposed = steps[max(steps)].exposed if steps else {}
    for r in ranks:
        if r["rank"] in out:
            continue
        if r["rank"] in slow:
            out[r["rank"]] = (
                "slow",
                {
                    "role": "culprit",
                    "compute_ratio": round(slow[r["rank"]], 3),
                    "reason": f"compute {slow[r['rank']]:.2f}x the peer median",
                },
            )
            continue
        detail = {}
        waited = exposed.get(r["rank"])
        if slow and waited:
            detail = {
                "role": "victim",
                "waiting_on": sorted(slow),
                "reason": f"exposed comm {waited * 1000:.0f} ms waiting on straggler(s) "
                f"{sorted(slow)}",
            }
        out[r["rank"]] = ("healthy", detail)
    return out


def _unheard_since_death(rank: Any, seen: float) -> bool:
    """A rank declared dead stays dead until it is heard from again: a collector whose lag
    grew since (which raises the dead threshold) does not bring it back to life."""
    return rank["state"] == "dead" and seen <= (rank["state_since"] or 0.0)


_RANK_FIELDS = (
    "rank",
    "state",
    "state_detail",
    "last_seen",
    "heartbeat_s",
    "progress_at",
    "clock_skew_s",
    "last_step",
    "phase",
    "state_since",
)


MAX_RANK_RUNS = 64  # runs of heard ranks a query names at most


def rank_runs(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """Ranks as the fewest runs of consecutive ones, (first, last) each, in order: the
    ranks refused past capacity (thousands) as a handful of ranges in SQL, not as a
    bound value each to compile and send on every evaluation."""
    runs: list[tuple[int, int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return runs


def evaluate(
    conn: Connection,
    *,
    now: float | None = None,
    settings: HealthSettings | None = None,
    lag_s: float = 0.0,
    pressed: bool = False,
    heard: Callable[[str], Mapping[int, float]] | None = None,
    board: Any = None,
) -> int:
    """Bring every live rank's state up to date; returns the number of state changes.

    ``lag_s``: how far behind the collector's own ingest is (requests waiting to be
    read or written); it is added to the dead and hung thresholds, so an overloaded
    collector does not declare its ranks dead for its own delay. ``pressed``: the
    collector fell behind or refused requests lately (``Pressure``); then how much later
    than their heartbeat the run's live ranks have been arriving is added instead, when
    that is more: requests refused 503, or read late, space every rank out. ``heard``:
    a run's ranks whose requests the collector refused, and when (``Pressure.heard``).

    Hung is read from what the rank itself said: how long it had gone without a step
    when it sent its latest request, by its own clock; a request kept waiting, or a node
    whose clock is off, does not make a rank look hung.

    A run with hung ranks: its ranks are asked for their Flight Recorder rings, and the
    verdict on them (:mod:`.hang`) names the culprit in the hung ranks' details.
    ``board``: the collector's command board, told when a request is made."""
    now = time.time() if now is None else now
    hang.close_requests(conn, now)
    settings = settings or HealthSettings()
    changes = 0
    runs = conn.execute(
        select(m.runs.c.id, m.runs.c.name, m.runs.c.world_size).where(m.runs.c.status == "running")
    ).all()
    for run_id, world in replicas.ended_runs(conn, now=now):  # their last checks
        events = replicas.compare(conn, run_id=run_id, world=world, now=now, ended=True)
        _events(conn, run_id=run_id, now=now, events=events)
    for run_id, world in samples.ended_runs(conn, now=now):  # their last sample digests
        events = samples.duplicates(conn, run_id=run_id, world=world, now=now, ended=True)
        events += samples.drift(conn, run_id=run_id, world=world, now=now, ended=True)
        _events(conn, run_id=run_id, now=now, events=events)
    for run_id, world in coverage.ended_runs(conn, now=now):  # their last epochs
        events = coverage.judge(conn, run_id=run_id, world=world, now=now, ended=True)
        _events(conn, run_id=run_id, now=now, events=events)
    changes += _place_ended(conn, now=now)
    for run_id, name, world in runs:
        window = max(settings.straggler_window, settings.divergence_window)
        steps = _recent_views(conn, run_id, world, window)
        slow = stragglers(steps, ratio=settings.straggler_ratio, window=settings.straggler_window)
        median_step = _median_step_time(conn, run_id)
        late = max(lag_s, arrival_lateness(conn, run_id)) if pressed else lag_s
        k = m.ranks.c
        heard_ranks = heard(name) if heard else None
        silent = k.last_seen < now - late - settings.dead_after_beats * func.coalesce(
            k.heartbeat_s, 2.0
        )
        # A dead rank not heard from since stays dead, its detail the same: it is not read
        # (a crashed run of 16,384 ranks would otherwise be read and decided again on every
        # evaluation, for as long as the run is watched). _states still blames it (still_dead).
        unheard = k.last_seen <= func.coalesce(k.state_since, 0.0)  # _unheard_since_death
        still_dead = (k.state == "dead") & (silent | unheard)
        if heard_ranks:  # as runs of ranks: a refused node's are consecutive
            spans = rank_runs(heard_ranks)
            if len(spans) <= MAX_RANK_RUNS:
                still_dead = still_dead & ~or_(*(k.rank.between(lo, hi) for lo, hi in spans))
            else:  # scattered: read the silent dead ranks too (what this saves is not worth it)
                still_dead = false()
        query = select(*(k[c] for c in _RANK_FIELDS)).where(
            k.run_id == run_id, k.state.in_(LIVE), ~still_dead
        )
        if not slow:  # read only the ranks whose state can change (a large run: a handful)
            hung_after = max(settings.hung_min_s, settings.hung_steps * (median_step or 0.0))
            query = query.where(
                or_(
                    k.state != "healthy",
                    k.state_detail.is_not(None),
                    silent,
                    # _idle_s, at its most (late 0)
                    k.progress_at + func.coalesce(k.clock_skew_s, 0.0) < now - hung_after,
                )
            )
        # In rank order, the order ingest locks rank rows in: no deadlocks.
        ranks = conn.execute(query.order_by(k.rank)).mappings().all()
        _events(
            conn,
            run_id=run_id,
            now=now,
            events=[
                dict(
                    rank=rank,
                    kind="loss_divergence",
                    severity="warning",
                    step=first,
                    uid=f"divergence:{run_id}:{rank}:{first}",
                    data={
                        "robust_z": round(z, 2),
                        "steps": settings.divergence_window,
                        "reason": "loss outside its peers' band: silent data corruption suspect",
                    },
                )
                for rank, (z, first) in diverging(
                    steps, z=settings.divergence_z, window=settings.divergence_window
                ).items()
            ],
        )
        # One batch on several ranks of a data-parallel group; a replayed step on other
        # samples than its first execution (samples.py).
        _events(
            conn,
            run_id=run_id,
            now=now,
            events=samples.duplicates(conn, run_id=run_id, world=world, now=now)
            + samples.drift(conn, run_id=run_id, world=world, now=now)
            # An epoch's repeated and missing samples; the data mixture's shares.
            + coverage.judge(conn, run_id=run_id, world=world, now=now)
            + mixture.drift(conn, run_id=run_id, now=now),
        )
        # Replicas that disagree: silent data corruption (replicas.py).
        _events(
            conn,
            run_id=run_id,
            now=now,
            events=replicas.compare(conn, run_id=run_id, world=world, now=now),
        )
        if not ranks:
            continue
        unread = select(k.rank).where(k.run_id == run_id, still_dead)

        def dead_unread(unread: Any = unread) -> list[int]:
            return list(conn.execute(unread).scalars())

        # Asked at most once a pass, and only for a rank found dead with no role of its own.
        places = functools.cache(functools.partial(endings.standing_places, conn, run_id))

        states = _states(
            list(ranks),
            now=now,
            settings=settings,
            median_step=median_step,
            slow=slow,
            steps=steps,
            lag_s=late,
            heard=heard_ranks,
            still_dead=dead_unread,
            places=places,
        )
        found_dead = [r for r, (state, _) in states.items() if state == "dead"]
        if found_dead:  # what a rank found dead died of, if a survivor of its node said
            for rank, data in crashes.current(conn, run_id, found_dead).items():
                states[rank] = ("dead", crashes.amend(states[rank][1], rank, data))
        events = []
        if any(state == "hung" for state, _ in states.values()):
            dead = [r for r, (state, _) in states.items() if state == "dead"]
            events += hang.refine(
                conn,
                run_id=run_id,
                run=name,
                world=world,
                ranks=list(ranks),
                states=states,
                dead=dead + dead_unread(),
                now=now,
                board=board,
            )
        moved, events = _write_states(
            conn, run_id=run_id, ranks=ranks, states=states, events=events, now=now
        )
        changes += moved
        _events(conn, run_id=run_id, now=now, events=events)
    return changes


def _write_states(
    conn: Connection,
    *,
    run_id: int,
    ranks: Sequence[Any],
    states: Mapping[int, tuple[str, dict[str, Any]]],
    events: list[dict[str, Any]],
    now: float,
) -> tuple[int, list[dict[str, Any]]]:
    """Write the pass's verdicts on ``ranks`` (as the pass read them); returns how many
    ranks changed state, and ``events`` with a ``rank_state`` event for each."""
    # Decide everything first, then write in two statements in rank order: the rank
    # rows stay locked for as short a time as possible (ingest updates them too).
    details, changed = [], []
    for r in ranks:
        state, detail = states[r["rank"]]
        if state == r["state"]:  # same state: rewrite the detail only if its gist changed
            before = r["state_detail"] or {}
            if (detail.get("role"), detail.get("waiting_on"), detail.get("collective")) != (
                before.get("role"),
                before.get("waiting_on"),
                before.get("collective"),
            ):
                details.append({"b_rank": r["rank"], "detail": detail or None})
            continue
        changed.append(
            {
                "b_rank": r["rank"],
                "b_from": r["state"],
                "state": state,
                "detail": detail or None,
            }
        )
        severity = {"healthy": "info", "slow": "warning"}.get(state, "critical")
        events.append(
            dict(
                rank=r["rank"],
                kind="rank_state",
                severity=severity,
                uid=f"state:{run_id}:{r['rank']}:{state}:{now}",
                step=r["last_step"],
                data={"from": r["state"], "to": state, **detail},
            )
        )
    where = (m.ranks.c.run_id == run_id) & (m.ranks.c.rank == bindparam("b_rank"))
    if details:
        conn.execute(update(m.ranks).where(where).values(state_detail=bindparam("detail")), details)
    if changed:
        # Only from the state this pass read: a goodbye stored meanwhile (the rank
        # finished) is not overwritten with what the pass made of its last steps.
        conn.execute(
            update(m.ranks)
            .where(where, m.ranks.c.state == bindparam("b_from"))
            .values(state=bindparam("state"), state_since=now, state_detail=bindparam("detail")),
            changed,
        )
        k = m.ranks.c
        now_in: dict[int, str] = {
            rank: state
            for rank, state in conn.execute(
                select(k.rank, k.state).where(
                    k.run_id == run_id, k.rank.in_([c["b_rank"] for c in changed])
                )
            )
        }
        applied = [
            e
            for e in events
            if e["kind"] != "rank_state" or now_in.get(e["rank"]) == e["data"]["to"]
        ]
        events = applied
    return sum(1 for e in events if e["kind"] == "rank_state"), events


def evaluate_once(
    engine: Engine, settings: HealthSettings, pressure: Pressure | None = None, board: Any = None
) -> int:
    """One evaluation in its own transaction; on PostgreSQL only one collector runs it."""
    with write(engine) as conn:
        if not is_sqlite(conn):
            locked = conn.execute(
                text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": ADVISORY_LOCK_KEY}
            ).scalar()
            if not locked:
                return 0
        if pressure is None:
            return evaluate(conn, settings=settings, board=board)
        return evaluate(
            conn,
            settings=settings,
            lag_s=pressure.lag_s(),
            pressed=pressure.pressed(),
            heard=pressure.heard,
            board=board,
        )


def health_loop(
    engine: Engine,
    settings: HealthSettings | None = None,
    pressure: Pressure | None = None,
    board: Any = None,
    observe: Callable[[float], object] | None = None,
) -> Loop:
    """The evaluator's thread inside ``serve``; ``pressure``: the collector's delay and
    whether it fell behind lately; ``board``: the commands board (collectives requests);
    ``observe``: told the seconds of each pass done (``/metrics``)."""
    settings = settings or HealthSettings()

    def work() -> None:
        started = time.perf_counter()
        evaluate_once(engine, settings, pressure, board)
        if observe is not None:
            observe(time.perf_counter() - started)

    return Loop(
        "trainwarden-health", settings.interval_s, work, max_cpu_share=settings.max_cpu_share
    )
