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

The parts: the step views and who is slow or diverging (``step_views.py``), each rank's
state and detail (``rank_states.py``, pure), what a pass writes (``writes.py``), the ranks
that ended hung before a verdict (``ended_hangs.py``), the settings (``settings.py``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, Engine, false, func, or_, select, text

from trainwarden.alerts.snapshot import LIVE_STATES
from trainwarden.collector.health import (
    coverage,
    crash_loops,
    hang,
    mixture,
    preflight,
    repeat_offenders,
    replicas,
    samples,
)
from trainwarden.collector.health.ended_hangs import place_ended
from trainwarden.collector.health.rank_states import decide_states
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.health.step_views import (
    diverging,
    median_step_time,
    recent_views,
    stragglers,
)
from trainwarden.collector.health.writes import insert_events, write_states
from trainwarden.collector.ingest import crashes, endings
from trainwarden.collector.ingest.limits import Pressure
from trainwarden.collector.loops import Loop
from trainwarden.collector.read.queries import arrival_lateness
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import is_sqlite, write

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_6865_616C  # "twheal": one evaluator across collectors
LIVE = LIVE_STATES


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
        insert_events(conn, run_id=run_id, now=now, events=events)
    for run_id, world in samples.ended_runs(conn, now=now):  # their last sample digests
        events = samples.duplicates(conn, run_id=run_id, world=world, now=now, ended=True)
        events += samples.drift(conn, run_id=run_id, world=world, now=now, ended=True)
        insert_events(conn, run_id=run_id, now=now, events=events)
    for run_id, world in preflight.ended_runs(conn, now=now):  # a short job's preflight
        events = preflight.failures(conn, run_id, world, now=now, ended=True)
        insert_events(conn, run_id=run_id, now=now, events=events)
    for run_id, world in coverage.ended_runs(conn, now=now):  # their last epochs
        events = coverage.judge(conn, run_id=run_id, world=world, now=now, ended=True)
        insert_events(conn, run_id=run_id, now=now, events=events)
    changes += place_ended(conn, now=now)
    offending = repeat_offenders.find(
        conn, (run_id for run_id, _, _ in runs), now=now, settings=settings.offenders
    )
    for run_id, name, world in runs:
        window = max(settings.straggler_window, settings.divergence_window)
        steps = recent_views(conn, run_id, world, window)
        slow = stragglers(steps, ratio=settings.straggler_ratio, window=settings.straggler_window)
        median_step = median_step_time(conn, run_id)
        late = max(lag_s, arrival_lateness(conn, run_id)) if pressed else lag_s
        k = m.ranks.c
        heard_ranks = heard(name) if heard else None
        silent = k.last_seen < now - late - settings.dead_after_beats * func.coalesce(
            k.heartbeat_s, 2.0
        )
        # A dead rank not heard from since stays dead, its detail the same: it is not read
        # (a crashed run of 16,384 ranks would otherwise be read and decided again on every
        # evaluation, for as long as the run is watched). decide_states still blames it
        # (still_dead).
        unheard = k.last_seen <= func.coalesce(k.state_since, 0.0)  # rank_states, unheard
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
                    # rank_states._idle_s, at its most (late 0)
                    k.progress_at + func.coalesce(k.clock_skew_s, 0.0) < now - hung_after,
                )
            )
        # In rank order, the order ingest locks rank rows in: no deadlocks.
        ranks = conn.execute(query.order_by(k.rank)).mappings().all()
        insert_events(
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
        insert_events(
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
        insert_events(
            conn,
            run_id=run_id,
            now=now,
            events=replicas.compare(conn, run_id=run_id, world=world, now=now),
        )
        # Attempts that are a crash loop; a rank on a node other runs found bad; ranks
        # that failed their preflight.
        insert_events(
            conn,
            run_id=run_id,
            now=now,
            events=crash_loops.find(conn, run_id, now=now, settings=settings.crash_loop)
            + offending.get(run_id, [])
            + preflight.failures(conn, run_id, world, now=now),
        )
        if not ranks:
            continue
        unread = select(k.rank).where(k.run_id == run_id, still_dead)

        def dead_unread(unread: Any = unread) -> list[int]:
            return list(conn.execute(unread).scalars())

        # Asked at most once a pass, and only for a rank found dead with no role of its own.
        places = functools.cache(functools.partial(endings.standing_places, conn, run_id))

        states = decide_states(
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
        else:
            hang.forget(conn.engine, run_id)
        moved, events = write_states(
            conn, run_id=run_id, ranks=ranks, states=states, events=events, now=now
        )
        changes += moved
        insert_events(conn, run_id=run_id, now=now, events=events)
    return changes


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
