"""Crash loops (``collector/health/crash_loops.py``) on a real database, SQLite and
PostgreSQL: attempts and their processes' ends as ingest stores them, and the verdict."""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert

from trainwarden.collector.health.crash_loops import LoopSettings, find
from trainwarden.collector.store import models as m

T0 = 1_700_000_000.0


def run_of(
    engine: Any, attempts: list[list[dict[str, Any]]], *, gap_s: float = 120.0, name: str = "loop"
) -> int:
    """A run whose attempt ``i`` (1, 2, ...) begins ``gap_s`` after the one before and has
    a process a dict of ``attempts[i - 1]``: ``rank``, ``host``, ``last_step``,
    ``end_reason`` (None: no goodbye), ``end_detail``, ``exit_code``."""
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(m.runs).values(name=name, world_size=2, created_at=T0, updated_at=T0)
        ).inserted_primary_key[0]
        for number, sessions in enumerate(attempts, start=1):
            started = T0 + (number - 1) * gap_s
            conn.execute(
                insert(m.attempts).values(
                    run_id=run_id, number=number, started_at=started, nodes=[]
                )
            )
            for s in sessions:
                ended = s.get("end_reason") is not None
                conn.execute(
                    insert(m.attempt_sessions).values(
                        session=f"{name}-a{number}-r{s['rank']}",
                        run_id=run_id,
                        attempt=number,
                        rank=s["rank"],
                        host=s.get("host", f"node{s['rank']}"),
                        started_at=started,
                        first_step=0,
                        last_step=s.get("last_step"),
                        # the first to fail went silent first; its peers followed
                        last_seen=started + gap_s - s.get("before_s", 10),
                        ended_at=started + gap_s - s.get("before_s", 10) if ended else None,
                        end_reason=s.get("end_reason"),
                        end_detail=s.get("end_detail"),
                        exit_code=s.get("exit_code"),
                    )
                )
    return int(run_id)


def died(at: int = 33, *, rank: int = 1, host: str | None = None) -> list[dict[str, Any]]:
    """An attempt in which ``rank`` dies at step ``at`` without a goodbye and the launcher
    tears the other rank down (SIGTERM)."""
    other = 1 - rank
    return [
        {"rank": other, "last_step": at, "end_reason": "sigterm"},
        {
            "rank": rank,
            "host": host or f"node{rank}",
            "last_step": at,
            "end_reason": "lost",
            "before_s": 12,
        },
    ]


def verdict(engine: Any, run_id: int, now: float, **settings: Any) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return find(conn, run_id, now=now, settings=LoopSettings(**settings))


def test_three_attempts_that_die_at_the_same_step_on_one_rank_are_a_loop(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = run_of(engine, [died(), died(), died(), [{"rank": 0, "last_step": 31}]])
    (event,) = verdict(engine, run_id, T0 + 400)
    assert (event["kind"], event["rank"], event["step"]) == ("crash_loop", 1, 33)
    assert event["uid"] == f"crash_loop:{run_id}:3"
    data = event["data"]
    assert (data["attempts"], data["steps"], data["ranks"], data["nodes"]) == (
        [1, 2, 3],
        [33, 33, 33],
        [1],
        ["node1"],
    )
    assert data["ways"] == ["killed (no goodbye)"]
    assert data["reason"] == (
        "attempts 1-3 each failed at step 33, no further; "
        "each time rank 1 on node node1 killed (no goodbye)"
    )


def test_the_newest_attempt_counts_once_every_process_said_how_it_ended(engine) -> None:  # type: ignore[no-untyped-def]
    exception = [
        {"rank": 0, "last_step": 5, "end_reason": "sigterm"},
        {"rank": 1, "last_step": 5, "end_reason": "exception", "end_detail": "ValueError: bad"},
    ]
    run_id = run_of(engine, [exception, exception, exception])
    (event,) = verdict(engine, run_id, T0 + 400)
    assert event["data"]["ways"] == ["ended on an exception: ValueError: bad"]
    assert event["data"]["attempts"] == [1, 2, 3]


def test_attempts_that_get_further_each_time_are_not_a_loop(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = run_of(
        engine, [died(33), died(60), died(90), []], gap_s=600.0
    )  # slow crashes, each past the one before
    assert verdict(engine, run_id, T0 + 2000) == []
    # ... unless each failed within minutes of its start
    assert len(verdict(engine, run_id, T0 + 2000, quick_s=700.0)) == 1


def test_preemptions_two_crashes_and_an_old_loop_are_not_a_loop(engine) -> None:  # type: ignore[no-untyped-def]
    preempted = [
        {"rank": 0, "last_step": 33, "end_reason": "sigterm"},
        {"rank": 1, "last_step": 33, "end_reason": "sigterm"},
    ]
    run_id = run_of(engine, [died(), preempted, died(), []])
    assert verdict(engine, run_id, T0 + 400) == []  # attempt 2 was stopped, not a crash
    two = run_of(engine, [died(), died(), []], name="two")
    assert verdict(engine, two, T0 + 400) == []
    old = run_of(engine, [died(), died(), died(), []], name="old")
    assert verdict(engine, old, T0 + 400, window_s=200.0) == []  # began more than window_s ago


def test_a_loop_with_nothing_in_common_says_so(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = run_of(engine, [died(rank=1), died(rank=0), died(rank=1), []])
    (event,) = verdict(engine, run_id, T0 + 400)
    assert event["rank"] is None and event["data"]["ranks"] == []
    assert event["data"]["reason"].endswith("; each time killed (no goodbye)")


def test_the_process_that_failed_first_is_named_not_its_torn_down_peer(engine) -> None:  # type: ignore[no-untyped-def]
    # Under load the launcher's SIGTERM can kill rank 0 before its goodbye is sent: it
    # ends without one too, but its heartbeats went on (blocked in a collective) until
    # then, after rank 1 had gone silent.
    both_lost = [
        {"rank": 0, "last_step": 20, "end_reason": "lost", "before_s": 10},
        {"rank": 1, "last_step": 19, "end_reason": "lost", "before_s": 12},
    ]
    run_id = run_of(engine, [both_lost, both_lost, died(20), []])
    (event,) = verdict(engine, run_id, T0 + 400)
    assert (event["rank"], event["data"]["ranks"]) == (1, [1])


def test_a_signal_in_the_last_words_is_the_way_they_failed(engine) -> None:  # type: ignore[no-untyped-def]
    run_id = run_of(engine, [died(), died(), died(), []])
    with engine.begin() as conn:
        for number in (1, 2, 3):
            conn.execute(
                insert(m.events).values(
                    uid=f"crash-{number}",
                    run_id=run_id,
                    rank=1,
                    ts=T0 + 120 * (number - 1) + 100,
                    recv_ts=T0 + 120 * (number - 1) + 100,
                    kind="rank_crashed",
                    severity="critical",
                    data={
                        "session": f"loop-a{number}-r1",
                        "signal": "SIGSEGV",
                        "collective": "all_reduce",
                        "last_step": 33,
                    },
                )
            )
    (event,) = verdict(engine, run_id, T0 + 400)
    assert event["data"]["ways"] == ["died of SIGSEGV in all_reduce"]
    assert event["data"]["reason"].endswith(
        "each time rank 1 on node node1 died of SIGSEGV in all_reduce"
    )


def test_an_attempt_trainwarden_stopped_did_not_crash(engine) -> None:  # type: ignore[no-untyped-def]
    # The stop reached rank 0 only (rank 1 of the new attempt was not in yet): rank 1
    # then failed in the collective rank 0 left. Not a fourth crash: no second loop.
    stopped = [
        {"rank": 0, "last_step": 0, "end_reason": "stopped", "exit_code": 76},
        {"rank": 1, "last_step": 1, "end_reason": "exception", "end_detail": "gloo: peer gone"},
    ]
    run_id = run_of(engine, [died(), died(), died(), stopped, []])
    assert verdict(engine, run_id, T0 + 600) == []
