"""Rank health rules over hand-built histories, with a controlled clock."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from trainwarden.collector import models as m
from trainwarden.collector.db import write
from trainwarden.collector.health import HealthSettings, evaluate
from trainwarden.collector.ingest import ingest
from trainwarden.collector.rollup_worker import flush
from trainwarden.collector.schemas import IngestBatch

from .helpers import batch, step

T0 = 1_700_000_000.0


def send(engine, *, rank: int, world: int = 2, steps=(), at: float, phase=None, in_step=False,
         last_step=None, heartbeat: float = 2.0, session: str | None = None) -> None:  # fmt: skip
    body = batch(rank=rank, world_size=world, steps=list(steps), session=session)
    done = [s["step"] for s in steps]
    last = last_step if last_step is not None else (max(done) if done else None)
    # A batch with steps means a step just ended; a bare heartbeat leaves progress as it was.
    body["agent"].update(heartbeat_s=heartbeat, last_step=last, in_step=in_step, phase=phase, sent_at=at,
                         last_step_end=at if done else None)  # fmt: skip
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=at)


def states(
    engine, now: float, settings: HealthSettings | None = None
) -> dict[int, tuple[str, dict]]:
    flush(engine, now=now, grace_s=0)
    with write(engine) as conn:
        evaluate(conn, now=now, settings=settings or HealthSettings())
        rows = conn.execute(select(m.ranks.c.rank, m.ranks.c.state, m.ranks.c.state_detail)).all()
    return {r: (s, d or {}) for r, s, d in rows}


def timed_step(n: int, *, compute: float, exposed: float = 0.0, loss: float = 1.0) -> dict:
    return {
        **step(n, loss=loss, duration=compute + exposed),
        "compute_s": compute,
        "exposed_comm_s": exposed,
    }


def test_healthy_ranks_stay_healthy(engine) -> None:
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i) for i in range(10)], at=T0 + 10)
    assert {r: s for r, (s, _) in states(engine, T0 + 11).items()} == {0: "healthy", 1: "healthy"}


def test_no_heartbeat_is_dead_and_its_blocked_peer_is_a_victim(engine) -> None:
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i) for i in range(10)], at=T0 + 10)
    # Rank 1 dies; rank 0 keeps beating from inside step 10's allreduce.
    send(engine, rank=0, at=T0 + 17, in_step=True, phase="backward", last_step=9)
    result = states(engine, T0 + 17.5)  # 7.5 s = 3.75 beats since rank 1's last
    assert result[1][0] == "dead" and result[1][1]["role"] == "culprit"
    assert result[0][0] == "hung" and result[0][1] == {
        **result[0][1],
        "role": "victim",
        "waiting_on": [1],
    }


def test_dead_after_two_and_a_quarter_missed_beats(engine) -> None:
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(0)], at=T0 + 1)
    assert states(engine, T0 + 1 + 4.4)[1][0] == "healthy"  # 2.2 beats
    assert states(engine, T0 + 1 + 4.6)[1][0] == "dead"  # 2.3 beats


def test_a_hung_rank_is_the_culprit_and_its_peer_the_victim(engine) -> None:
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i) for i in range(10)], at=T0 + 10)
    # Both beat; neither completes step 10: rank 1 stopped before forward, rank 0 waits in backward.
    send(engine, rank=1, at=T0 + 14.5, in_step=True, phase=None, last_step=9)
    send(engine, rank=0, at=T0 + 14.5, in_step=True, phase="backward", last_step=9)
    assert states(engine, T0 + 14.5)[1][0] == "healthy"  # 4.5 s since step 9 ended (T0+10)
    result = states(engine, T0 + 15.5)  # 5.5 s: past the 5 s floor
    assert result[1][0] == "hung" and result[1][1]["role"] == "culprit"
    assert (
        result[0][0] == "hung"
        and result[0][1]["role"] == "victim"
        and result[0][1]["waiting_on"] == [1]
    )
    # Progress again: both healthy, and each change is an event.
    send(engine, rank=1, steps=[step(10)], at=T0 + 17)
    send(engine, rank=0, steps=[step(10)], at=T0 + 17)
    assert {s for s, _ in states(engine, T0 + 17).values()} == {"healthy"}
    with engine.connect() as conn:
        kinds = (
            conn.execute(select(m.events.c.data).where(m.events.c.kind == "rank_state"))
            .scalars()
            .all()
        )
    assert [(d["from"], d["to"]) for d in kinds].count(("hung", "healthy")) == 2


def test_hung_threshold_scales_with_slow_steps(engine) -> None:
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i, duration=4.0) for i in range(5)], at=T0 + 6)
    # 5 x 4 s median step = 20 s: a 12 s gap is a long step, not a hang.
    for rank in (0, 1):
        send(engine, rank=rank, at=T0 + 18, in_step=True, phase="forward", last_step=4)
    assert states(engine, T0 + 18)[0][0] == "healthy"
    for rank in (0, 1):
        send(engine, rank=rank, at=T0 + 27, in_step=True, phase="forward", last_step=4)
    assert states(engine, T0 + 27)[0][0] == "hung"  # 21 s without progress


@pytest.mark.parametrize("world", [2, 8])
def test_a_straggler_is_the_culprit_and_waiting_peers_are_victims(engine, world: int) -> None:
    slow = world - 1
    steps = {rank: [] for rank in range(world)}
    for i in range(12):
        for rank in range(world):
            if rank == slow and i >= 4:
                steps[rank].append(timed_step(i, compute=0.13))
            else:
                steps[rank].append(timed_step(i, compute=0.10, exposed=0.03 if i >= 4 else 0.0))
    for rank in range(world):
        send(engine, rank=rank, world=world, steps=steps[rank], at=T0 + 12)
    result = states(engine, T0 + 12.5)
    assert result[slow][0] == "slow" and result[slow][1]["compute_ratio"] == pytest.approx(1.3)
    for rank in set(range(world)) - {slow}:
        assert result[rank][0] == "healthy"
        assert result[rank][1]["role"] == "victim" and result[rank][1]["waiting_on"] == [slow]


def test_loss_divergence_needs_a_streak_and_three_ranks(engine) -> None:
    for rank in range(4):
        losses = [1.0 + 0.01 * rank] * 6 + ([5.0] * 6 if rank == 2 else [1.0 + 0.01 * rank] * 6)
        send(
            engine,
            rank=rank,
            world=4,
            steps=[step(i, loss=v) for i, v in enumerate(losses)],
            at=T0 + 12,
        )
    states(engine, T0 + 12.5)
    states(engine, T0 + 13.5)  # evaluated twice: still one event
    with engine.connect() as conn:
        rows = conn.execute(
            select(m.events.c.rank, m.events.c.step).where(m.events.c.kind == "loss_divergence")
        ).all()
    assert rows == [(2, 7)]


def test_median_without_matches_the_slow_way() -> None:
    import random
    import statistics

    from trainwarden.collector.health import median_without

    rng = random.Random(1)
    for n in range(2, 12):
        values = sorted(rng.random() for _ in range(n))
        for i in range(n):
            assert median_without(values, i) == pytest.approx(
                statistics.median(values[:i] + values[i + 1 :])
            )


def test_the_collectors_own_lag_is_not_a_dead_rank(engine) -> None:
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(0)], at=T0 + 1)
    send(engine, rank=0, at=T0 + 5, last_step=0)  # rank 0 beats, rank 1's request is late
    flush(engine, now=T0 + 6.5, grace_s=0)
    with write(engine) as conn:  # the collector is 3 s behind on its own ingest
        evaluate(conn, now=T0 + 6.5, settings=HealthSettings(), lag_s=3.0)
        assert dict(conn.execute(select(m.ranks.c.rank, m.ranks.c.state)).all())[1] == "healthy"
    assert states(engine, T0 + 6.5)[1][0] == "dead"  # no lag: 5.5 s of silence is 2.75 beats


def test_the_writers_lag_is_the_age_of_its_oldest_waiting_request(engine) -> None:
    import threading

    from trainwarden.collector.schemas import ColumnarBatch
    from trainwarden.collector.writer import IngestWriter

    writer = IngestWriter(engine)
    assert writer.lag_s() == 0.0
    gate = threading.Event()
    writer.on_flush = lambda *_: gate.wait(10)
    body = {"run": "lag", "world_size": 1, "agents": [{"rank": 0, "host": "h", "session": "s"}],
            "steps": {"rank": [0], "step": [0], "ts": [T0], "duration_s": [0.1]}}  # fmt: skip
    done = writer.submit(ColumnarBatch.model_validate(body))
    while not writer.flushes:  # committed, now held in on_flush
        pass
    assert writer.lag_s(now=time.time() + 2.0) >= 2.0
    gate.set()
    done.result(10)
    writer.stop()
    assert writer.lag_s() == 0.0
