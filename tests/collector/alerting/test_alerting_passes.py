"""The alert engine's passes on a real database (SQLite and PostgreSQL): one at a time
across collectors, rank rows kept between passes, each rule's period, what a pass reads
(p99, a busy collector's refused requests) and how little it writes at scale."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy import select, update

from trainwarden.alerts import parse_rule
from trainwarden.collector.alerting.engine import AlertEngine
from trainwarden.collector.alerting.snapshot import recent_steps
from trainwarden.collector.ingest.limits import Pressure
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import step
from .alerting_helpers import EXTERNAL, RULES, T0, Engine, send, xid


def test_two_collectors_evaluating_at_once_page_once(engine) -> None:
    """Two engines (two collectors) on one database: one pass at a time (an advisory
    lock on PostgreSQL, the write lock on SQLite), so one alert row and one page."""
    import threading

    first, second = Engine(engine, "FatalXid"), Engine(engine, "FatalXid")
    second.sent = first.sent  # one pager
    second.restart()
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(79, T0, "x")])
    for t in (T0 + 1, T0 + 2, T0 + 3):
        threads = [
            threading.Thread(target=e.alerts.run_once, kwargs={"now": t}) for e in (first, second)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    with engine.connect() as conn:
        assert conn.execute(select(m.alerts.c.id)).scalars().all() != []
        assert len(conn.execute(select(m.alerts.c.id)).scalars().all()) == 1
    assert [n.status for n in first.sent] == ["firing"]


def test_a_pass_reads_a_rolled_up_step_once_and_again_when_its_rollup_changes(engine) -> None:
    """The engine keeps rolled-up steps' rank rows between passes (a rank-scoped rule's
    window at 4,096 ranks is 82,000 rows a pass): a cached step is not read again until
    a late row rolls it up again; a step still arriving is read on every pass."""
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(n) for n in (1, 2, 3)])
    send(engine, rank=0, at=T0, steps=[step(4)])  # rank 1's step 4 comes late
    flush(engine, now=T0 + 10, grace_s=0)
    send(engine, rank=0, at=T0 + 11, steps=[step(5)])  # not rolled up yet
    cols = ("compute_s", "duration_s")
    cache: dict[int, Any] = {}

    def read(**kw: Any) -> list[tuple[int, int, float]]:
        with engine.connect() as conn:
            run_id = conn.execute(select(m.runs.c.id)).scalar_one()
            rows = recent_steps(conn, run_id, since=1, cols=cols, **kw)
        return [(r["step"], r["rank"], r["duration_s"]) for r in rows]

    first = read(cache=cache)
    assert (
        first
        == read()
        == [(2, 0, 0.1), (2, 1, 0.1), (3, 0, 0.1), (3, 1, 0.1), (4, 0, 0.1), (5, 0, 0.1)]
    )
    (run_cache,) = cache.values()
    assert sorted(run_cache.steps) == [2, 3, 4]  # rolled up; step 5 is still arriving
    # A cached step is not read again: a change behind the rollup's back does not show...
    with write(engine) as conn:
        conn.execute(
            update(m.rank_steps).where(m.rank_steps.c.step.in_((3, 5))).values(duration_s=0.2)
        )
    assert read(cache=cache) == [*first[:2], (3, 0, 0.1), (3, 1, 0.1), (4, 0, 0.1), (5, 0, 0.2)]
    assert read()[2:4] == [(3, 0, 0.2), (3, 1, 0.2)]
    # ...but a late row that rolls its step up again does, and steps leave the window.
    send(engine, rank=1, at=T0 + 12, steps=[step(4, duration=0.3)])
    flush(engine, now=T0 + 20, grace_s=0)
    assert (4, 1, 0.3) in read(cache=cache)
    with engine.connect() as conn:
        run_id = conn.execute(select(m.runs.c.id)).scalar_one()
        recent_steps(conn, run_id, since=3, cols=cols, cache=cache)
    assert sorted(cache[run_id].steps) == [4, 5]
    # Peer rules read rolled-up steps only: step 6, still arriving, is not read at all.
    send(engine, rank=0, at=T0 + 21, steps=[step(6)])
    settled = read(cache=cache, arriving=False)
    assert {st for st, _, _ in settled} == {2, 3, 4, 5} and settled == read(arriving=False)
    assert (6, 0, 0.1) in read(cache=cache)


def test_a_rank_rule_that_must_hold_for_minutes_is_evaluated_every_for_over_20_s(engine) -> None:
    alerts = Engine(engine, "DataLoaderStall", "Straggler")
    assert alerts.alerts.period_s(RULES["DataLoaderStall"]) == 15.0  # for: 5m
    assert alerts.alerts.period_s(RULES["Straggler"]) == 2.0  # a peer rule: every pass
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(n, duration=1.0) for n in range(1, 21)])
    assert alerts.run(T0 + 1) == []  # evaluated: all fed
    for rank in (0, 1):  # rank 1 now waits half of each step for its input
        stalled = [step(n, duration=1.0, wait=0.5 if rank else 0.01) for n in range(21, 46)]
        send(engine, rank=rank, at=T0 + 2, steps=stalled)
    assert alerts.run(T0 + 3) == []  # not due again before T0 + 16
    assert alerts.run(T0 + 15.9) == []
    (row,) = alerts.run(T0 + 16)
    assert (row["rule"], row["state"], row["rank"]) == ("DataLoaderStall", "pending", 1)
    assert alerts.run(T0 + 18) == [row]  # not evaluated, left as it was
    # A pass without the slow rule reads the peer rule's 8 steps of every rank, not
    # DataLoaderStall's 20 (with its columns: the rows kept between passes serve both).
    engine_ = alerts.alerts
    both = engine_._needs_of_due([RULES["DataLoaderStall"], RULES["Straggler"]])
    peer = engine_._needs_of_due([RULES["Straggler"]])
    assert (both.steps_back, peer.steps_back) == (20, 8)
    # Rolled-up steps only, for both: the peer rule's way, and a rule evaluated every 15 s
    # gains nothing from steps still arriving (read again on every evaluation).
    assert not both.steps_arriving and not peer.steps_arriving
    assert peer.step_cols == both.step_cols >= {"data_wait_s", "compute_s"}
    # A rank rule evaluated every pass (a `for` of steps) reads the steps still arriving.
    quick = parse_rule(
        {
            "name": "QuickStall",
            "kind": "threshold",
            "summary": "A rank waits for its input.",
            "severity": "warning",
            "runbook": "DataLoaderStall.md",
            "params": {
                "scope": "rank",
                "metric": "data_wait",
                "fraction_of_step": True,
                "window": "5 steps",
                "above": 0.2,
            },
            "for": "5 steps",
        }
    )
    assert engine_.period_s(quick) == engine_.settings.interval_s
    assert engine_._needs_of_due([quick, RULES["DataLoaderStall"]]).steps_arriving


def test_a_run_rule_on_p99_sees_the_tail_the_median_hides(engine) -> None:
    def rule(stat: str) -> Any:
        return parse_rule(
            {
                "name": f"SlowTail{stat}",
                "kind": "threshold",
                "summary": "The slowest ranks' step time.",
                "severity": "warning",
                "runbook": "Straggler.md",
                "params": {"scope": "run", "metric": "step_time", "stat": stat, "above": 0.5},
            }
        )

    for rank in range(4):  # one rank of four takes 1 s: p99 0.97 s, median 0.1 s
        send(engine, rank=rank, world=4, at=T0, steps=[step(1, duration=1.0 if rank == 3 else 0.1)])
    flush(engine, now=T0 + 1, grace_s=0)
    alerts = AlertEngine(
        engine, [rule("p99"), rule("median")], external_url=EXTERNAL, submit=lambda _: None
    )
    alerts.run_once(now=T0 + 2)
    with engine.connect() as conn:
        found = conn.execute(select(m.alerts.c.rule, m.alerts.c.value)).all()
    assert [(name, round(value, 3)) for name, value in found] == [("SlowTailp99", 0.973)]


def test_rank_dead_does_not_page_for_a_collector_too_busy_to_take_the_ranks_requests(
    engine,
) -> None:
    alerts = Engine(engine, "RankDead")
    alerts.pressure = pressure = Pressure(lambda: 0.0)
    alerts.restart()
    now = time.time()  # the refusals are stamped with the wall clock
    for rank in (0, 1):
        send(engine, rank=rank, at=now - 10, steps=[step(0)])
    send(engine, rank=0, at=now, steps=[step(1)])
    pressure.refused("r1/1")  # rank 1's latest request was refused (503): it is alive
    assert alerts.run(now + 1) == []  # 11 s since rank 1 was last stored
    send(engine, rank=0, at=now + 3, steps=[step(2)])
    # Nothing from rank 1 since, taken or refused: dead after 2.25 beats, plus the 1 s
    # by which rank 0 last arrived later than its heartbeat (the collector was behind).
    assert alerts.run(now + 5) == []
    (row,) = alerts.run(now + 6)
    assert (row["rule"], row["rank"], row["state"]) == ("RankDead", 1, "firing")


def test_a_firing_alert_whose_value_alone_moves_is_rewritten_every_refresh_s(engine) -> None:
    """A dead rank's silence grows on every pass: its RankDead alert is written when it
    fires, then every ``refresh_s``, not on every pass (a crashed run of 16,384 ranks)."""
    alerts = Engine(engine, "RankDead", refresh_s=30.0)
    world = 8
    for rank in range(world):
        send(engine, rank=rank, world=world, at=T0, steps=[step(0)])
    fired = alerts.run(T0 + 10)
    assert len(fired) == world and {r["state"] for r in fired} == {"firing"}
    assert {r["updated_at"] for r in fired} == {T0 + 10} and {r["value"] for r in fired} == {10.0}

    def fields(rows):
        return [
            (r["rank"], r["value"], r["annotations"]["description"], r["updated_at"]) for r in rows
        ]

    assert fields(alerts.run(T0 + 12)) == fields(alerts.run(T0 + 39)) == fields(fired)
    later = alerts.run(T0 + 40)  # 30 s on: every alert's value and description, in one statement
    assert {(r["value"], r["updated_at"]) for r in later} == {(40.0, T0 + 40)}
    assert all("no heartbeat for 40.0s" in r["annotations"]["description"] for r in later)
    # A change of state is written at once: ranks 0-3 are back, their alerts resolve.
    for rank in range(4):
        send(engine, rank=rank, world=world, at=T0 + 41, steps=[step(1)])
    back = {r["rank"]: r for r in alerts.run(T0 + 41)}
    assert [back[r]["state"] for r in range(world)] == ["resolved"] * 4 + ["firing"] * 4


def test_a_whole_job_back_resolves_its_alerts_in_one_statement(engine) -> None:
    """Every rank of a dead job back at once (the job restarted): its RankDead alerts all
    resolve in one pass, written by one UPDATE for the resolve and one for the resolved
    notification, not two a rank (16,384 ranks at a restart)."""
    alerts = Engine(engine, "RankDead")
    world = 40
    for rank in range(world):
        send(engine, rank=rank, world=world, at=T0, steps=[step(0)])
    assert {r["state"] for r in alerts.run(T0 + 10)} == {"firing"}
    for rank in range(world):
        send(engine, rank=rank, world=world, at=T0 + 11, steps=[step(1)])
    written: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith(("UPDATE ALERTS", "DELETE FROM ALERTS")):
            written.append(statement)

    sa_event.listen(engine, "before_cursor_execute", count)
    try:
        rows = alerts.run(T0 + 11)
    finally:
        sa_event.remove(engine, "before_cursor_execute", count)
    assert [r["state"] for r in rows] == ["resolved"] * world
    assert len(written) == 2, written
    assert "resolved_at" in written[0] and "notified" in written[1], written


def test_a_run_silent_for_a_minute_is_evaluated_every_silent_every_s(engine) -> None:
    alerts = Engine(engine, "RankDead", refresh_s=0.0, silent_run_s=60.0, silent_every_s=30.0)
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(0)])

    def values(now: float) -> list[tuple[str, float]]:
        return [(r["state"], r["value"]) for r in alerts.run(now)]

    assert values(T0 + 10) == [("firing", 10.0)] * 2
    assert values(T0 + 59) == [("firing", 59.0)] * 2  # silent for less than a minute
    assert values(T0 + 61) == [("firing", 61.0)] * 2  # silent: evaluated now, then every 30 s
    assert values(T0 + 75) == [("firing", 61.0)] * 2  # sat out: its alerts left as they are
    assert values(T0 + 91) == [("firing", 91.0)] * 2
    send(engine, rank=0, at=T0 + 95, steps=[step(1)])  # heard again: evaluated on every pass
    assert values(T0 + 96) == [("resolved", 91.0), ("firing", 96.0)]
