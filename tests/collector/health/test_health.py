"""Rank health rules over hand-built histories, with a controlled clock."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from trainwarden.collector.health import evaluator as health
from trainwarden.collector.health.evaluator import evaluate
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step

T0 = 1_700_000_000.0


def send(
    engine,
    *,
    rank: int,
    world: int = 2,
    steps=(),
    at: float,
    phase=None,
    in_step=False,
    last_step=None,
    heartbeat: float = 2.0,
    session: str | None = None,
    late: float = 0.0,
) -> None:
    """A request that arrives at ``at``; ``late``: how long before that the agent sent
    it, by its own clock (a clock behind the collector's, or a request kept waiting)."""
    body = batch(rank=rank, world_size=world, steps=list(steps), session=session)
    done = [s["step"] for s in steps]
    last = last_step if last_step is not None else (max(done) if done else None)
    # A batch with steps means a step just ended; a bare heartbeat leaves progress as it was.
    body["agent"].update(
        heartbeat_s=heartbeat,
        last_step=last,
        in_step=in_step,
        phase=phase,
        sent_at=at - late,
        last_step_end=at - late if done else None,
    )
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


def test_a_rank_dead_since_an_earlier_evaluation_is_still_blamed_by_its_hung_peers(engine) -> None:
    for rank in (0, 1, 2):
        send(engine, rank=rank, world=3, steps=[step(i) for i in range(10)], at=T0 + 10)
    send(engine, rank=0, world=3, steps=[step(10)], at=T0 + 13)
    send(engine, rank=2, world=3, steps=[step(10)], at=T0 + 13)
    first = states(engine, T0 + 15)  # rank 1: 5 s silent, dead; its peers still make progress
    assert [first[r][0] for r in (0, 1, 2)] == ["healthy", "dead", "healthy"]
    # Later its peers block in step 11's allreduce; rank 1, dead all along, is not read
    # again, but it is what they wait on, not a hung culprit among them.
    for at in (T0 + 16, T0 + 19.5):
        for rank in (0, 2):
            send(engine, rank=rank, world=3, at=at, in_step=True, phase="backward", last_step=10)
    result = states(engine, T0 + 19.5)
    assert result[1][0] == "dead"
    for rank in (0, 2):
        assert result[rank][0] == "hung" and result[rank][1]["role"] == "victim"
        assert result[rank][1]["waiting_on"] == [1]


def test_a_silent_dead_run_is_not_read_again_and_a_rank_heard_again_comes_back(
    engine, monkeypatch
) -> None:
    """A crashed run's ranks stay dead without being decided again on every evaluation
    (a crashed run of thousands of ranks took a fifth of the collector's CPU that way)."""
    from trainwarden.collector.health import evaluator as health

    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i) for i in range(10)], at=T0 + 10)
    assert {s for s, _ in states(engine, T0 + 20).values()} == {"dead"}
    decided: list[list[int]] = []
    real = health.decide_states

    def spy(ranks, **kwargs):
        decided.append([r["rank"] for r in ranks])
        return real(ranks, **kwargs)

    monkeypatch.setattr(health, "decide_states", spy)
    assert {s for s, _ in states(engine, T0 + 60).values()} == {"dead"}
    assert decided == []  # nothing could have changed: nothing was read
    # A refused request of rank 1 (heard, not stored) is a sign of life; so is a request.
    assert evaluated(engine, T0 + 61, heard=lambda run: {1: T0 + 60.5}) == {0: "dead", 1: "healthy"}
    send(engine, rank=0, steps=[step(10)], at=T0 + 62)
    assert states(engine, T0 + 62)[0][0] == "healthy"
    assert decided == [[1], [0, 1]]


def test_dead_ranks_heard_in_runs_or_scattered_come_back_and_the_others_stay_dead(engine) -> None:
    """Past capacity thousands of ranks are heard (refused, alive): they are named to
    the query as runs of ranks, or, scattered, not named at all (every silent dead rank
    read); either way exactly the heard ones come back."""
    world = 200
    for rank in range(world):
        send(engine, rank=rank, world=world, steps=[step(0)], at=T0 + 10)
    assert {s for s, _ in states(engine, T0 + 20).values()} == {"dead"}
    in_runs = {r: T0 + 30.0 for r in [*range(10, 60), *range(100, 150)]}
    result = evaluated(engine, T0 + 31, heard=lambda run: in_runs)
    assert {r for r, s in result.items() if s == "healthy"} == set(in_runs)
    scattered = {r: T0 + 40.0 for r in range(1, world, 2)}  # 100 runs of one: past the cap
    assert len(health.rank_runs(scattered)) > health.MAX_RANK_RUNS
    result = evaluated(engine, T0 + 41, heard=lambda run: scattered)
    assert {r for r, s in result.items() if s == "healthy"} == set(scattered)


def test_rank_runs_are_the_fewest_ranges_in_order() -> None:
    assert health.rank_runs([]) == []
    assert health.rank_runs({7, 3, 4, 5, 9, 10, 0}) == [(0, 0), (3, 5), (7, 7), (9, 10)]
    assert health.rank_runs(range(4096)) == [(0, 4095)]


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

    from trainwarden.alerts.evaluate_metrics import median_without

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


def test_a_dead_rank_does_not_come_back_to_life_without_a_heartbeat(engine) -> None:
    """Declared dead with no lag, then the collector falls behind (its lag grows past the
    silence): the rank stays dead, one death, not dead -> healthy -> dead with nothing
    heard in between (seen under load: one silent rank declared dead twice, 7 s apart).
    A heartbeat after its death brings it back."""
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(0)], at=T0 + 1)
    send(engine, rank=0, at=T0 + 5, last_step=0)
    assert states(engine, T0 + 6.5)[1][0] == "dead"  # 5.5 s of silence: 2.75 beats
    send(engine, rank=0, at=T0 + 7, last_step=0)
    flush(engine, now=T0 + 7.5, grace_s=0)
    with write(engine) as conn:  # now 3 s behind: 6.5 s of silence is under 2.25 beats + lag
        evaluate(conn, now=T0 + 7.5, settings=HealthSettings(), lag_s=3.0)
    assert states(engine, T0 + 8.5)[1][0] == "dead"
    with engine.connect() as conn:
        moves = [
            (d["from"], d["to"])
            for d in conn.execute(
                select(m.events.c.data).where(m.events.c.kind == "rank_state", m.events.c.rank == 1)
            ).scalars()
        ]
    assert moves == [("healthy", "dead")], moves
    send(engine, rank=1, steps=[step(1)], at=T0 + 9)  # heard again
    assert states(engine, T0 + 9)[1][0] == "healthy"


def test_the_writers_lag_is_the_age_of_its_oldest_waiting_request(engine) -> None:
    import threading

    from trainwarden.collector.ingest.schema_columns import ColumnarBatch
    from trainwarden.collector.ingest.writer import IngestWriter

    writer = IngestWriter(engine)
    assert writer.lag_s() == 0.0
    gate = threading.Event()
    writer.on_flush = lambda *_: gate.wait(10)
    body = {
        "run": "lag",
        "world_size": 1,
        "agents": [{"rank": 0, "host": "h", "session": "s"}],
        "steps": {"rank": [0], "step": [0], "ts": [T0], "duration_s": [0.1]},
    }
    done = writer.submit(ColumnarBatch.model_validate(body))
    while not writer.flushes:  # committed, now held in on_flush
        pass
    assert writer.lag_s(now=time.time() + 2.0) >= 2.0
    gate.set()
    done.result(10)
    writer.stop()
    assert writer.lag_s() == 0.0


def beats(engine, ranks, *, every: float, times: int, start: float = T0 + 1) -> float:
    """Each rank of ``ranks`` completes a step and is heard from every ``every`` seconds,
    ``times`` times; returns when the last arrived."""
    at = start
    for n in range(times):
        at = start + n * every
        for rank in ranks:
            send(engine, rank=rank, world=4, steps=[step(n)], at=at)
    return at


def evaluated(engine, now: float, **kwargs) -> dict[int, str]:
    flush(engine, now=now, grace_s=0)
    with write(engine) as conn:
        evaluate(conn, now=now, settings=HealthSettings(), **kwargs)
        return dict(conn.execute(select(m.ranks.c.rank, m.ranks.c.state)).all())


def test_ingest_records_each_ranks_gap_between_arrivals(engine) -> None:
    send(engine, rank=0, steps=[step(0)], at=T0 + 1)
    send(engine, rank=0, steps=[step(1)], at=T0 + 4.5)
    send(engine, rank=1, steps=[step(0)], at=T0 + 1, session="a")
    send(engine, rank=1, steps=[step(0)], at=T0 + 9, session="b")  # a new process: no gap
    with engine.connect() as conn:
        gaps = dict(conn.execute(select(m.ranks.c.rank, m.ranks.c.arrival_gap_s)).all())
    assert gaps == {0: pytest.approx(3.5), 1: None}


def test_a_collector_that_fell_behind_allows_for_the_late_arrivals_it_caused(engine) -> None:
    # The collector refused requests (503): its live ranks got through 7 s apart instead
    # of every 2 s. Rank 3 was last heard 8 s ago: late like its peers, not dead.
    last = beats(engine, range(4), every=7.0, times=3)
    beats(engine, range(3), every=7.0, times=1, start=last + 7)
    now = last + 8
    assert evaluated(engine, now, pressed=True)[3] == "healthy"
    # A collector keeping up blames the rank: 8 s is 4 heartbeats.
    assert evaluated(engine, now, pressed=False)[3] == "dead"


def test_a_late_rank_is_dead_once_silent_past_its_peers_lateness(engine) -> None:
    last = beats(engine, range(4), every=7.0, times=3)
    beats(engine, range(3), every=7.0, times=1, start=last + 7)
    # Peers 5 s later than their 2 s heartbeat: dead after 2.25 beats + 5 s = 9.5 s.
    assert evaluated(engine, last + 9.4, pressed=True)[3] == "healthy"
    assert evaluated(engine, last + 9.6, pressed=True)[3] == "dead"


def test_one_late_rank_does_not_excuse_another_when_the_collector_kept_up(engine) -> None:
    last = beats(engine, range(4), every=1.0, times=10)
    beats(engine, [0, 1, 2], every=1.0, times=1, start=last + 1)
    send(engine, rank=2, world=4, at=last + 9, steps=[step(11)])  # rank 2 was 7 s late itself
    assert evaluated(engine, last + 9.5, pressed=True)[3] == "healthy"  # a busy collector's delay
    assert evaluated(engine, last + 9.5, pressed=False)[3] == "dead"


@pytest.mark.parametrize("late", [0.0, 30.0])
def test_progress_is_read_on_the_collectors_clock(engine, late: float) -> None:
    # The agent's clock is 30 s behind the collector's (or its request waited 30 s to be
    # read): the step it says ended 30 s "ago" ended just before it sent.
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i) for i in range(10)], at=T0 + 40, late=late)
    assert {r: s for r, (s, _) in states(engine, T0 + 41).items()} == {0: "healthy", 1: "healthy"}
    # And a rank that beats but makes no progress is hung whatever its clock says.
    send(engine, rank=0, at=T0 + 52, in_step=True, phase="forward", last_step=9, late=late)
    send(engine, rank=1, at=T0 + 52, in_step=True, phase="backward", last_step=9, late=late)
    result = states(engine, T0 + 52.5)
    assert result[0][0] == "hung" and result[0][1]["role"] == "culprit"
    assert "no step completed for 12.5s" in result[0][1]["reason"]  # since T0 + 40


def test_pressure_remembers_refusals_and_lag_for_a_while() -> None:
    from trainwarden.collector.ingest.limits import Pressure

    lag = [0.0]
    pressure = Pressure(lambda: lag[0], behind_s=1.0, memory_s=0.2)
    assert not pressure.pressed()
    pressure.refused()
    assert pressure.pressed()
    time.sleep(0.25)
    assert not pressure.pressed()
    lag[0] = 1.5
    assert pressure.lag_s() == 1.5 and pressure.pressed()
    lag[0] = 0.0
    assert pressure.pressed()  # still within memory_s of the lag
    time.sleep(0.25)
    assert not pressure.pressed()


def test_a_request_the_collector_refused_is_its_ranks_heartbeat(engine) -> None:
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i) for i in range(10)], at=T0 + 10)
    send(engine, rank=0, steps=[step(10)], at=T0 + 17)
    # Rank 1's requests since T0 + 10 were refused (503), the last at T0 + 16.5: alive,
    # and not hung either (what it sent may have said it made progress).
    assert evaluated(engine, T0 + 18, heard=lambda run: {1: T0 + 16.5})[1] == "healthy"
    assert evaluated(engine, T0 + 18)[1] == "dead"  # nothing heard: 8 s of silence


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("run-a/3", ("run-a", [3])),
        ("run-a/0-3", ("run-a", [0, 1, 2, 3])),
        ("r:1.b/0,2,4-5", ("r:1.b", [0, 2, 4, 5])),
        ("run-a/", None),
        ("/3", None),
        ("run-a", None),
        ("run-a/3-1", None),
        ("run-a/x", None),
        ("run-a/-3", None),
        ("run-a/0-99999999", None),  # more ranks than one request may vouch for
    ],
)
def test_the_sender_header_names_a_run_and_its_ranks(value: str, expected) -> None:
    from trainwarden.collector.ingest.limits import sender_ranks

    assert sender_ranks(value) == expected


def test_the_backpressure_gate_hands_on_who_it_refused() -> None:
    import asyncio
    import concurrent.futures

    from trainwarden.agent.exporter import SENDER_HEADER, sender
    from trainwarden.collector.ingest.limits import IngestBackpressure, Pressure

    async def app(scope, receive, send) -> None:  # never reached: the gate is full
        raise AssertionError("admitted")

    pressure = Pressure(lambda: 0.0)
    gate = IngestBackpressure(app, limit=1, on_reject=pressure.refused)
    gate.count.n = 1
    answers: list[dict] = []

    async def collect(message: dict) -> None:
        answers.append(message)

    header = sender({"run": "big-run", "agent": {"rank": 7}})
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/ingest",
        "headers": [(SENDER_HEADER.lower().encode(), header.encode())],
    }
    before = time.time()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # no loop of the caller's to nest in
        pool.submit(asyncio.run, gate(scope, None, collect)).result(30)
    assert answers[0]["status"] == 503
    length = dict(answers[0]["headers"])[b"content-length"]  # not chunked: any client reads it
    assert int(length) == len(answers[1]["body"])
    assert pressure.pressed() and list(pressure.heard("big-run")) == [7]
    assert pressure.heard("big-run")[7] >= before and pressure.heard("other") == {}


def test_what_refused_senders_claim_is_bounded(monkeypatch) -> None:
    from trainwarden.collector.ingest import limits

    monkeypatch.setattr(limits, "MAX_HEARD", 10_000)
    pressure = limits.Pressure(lambda: 0.0, memory_s=60.0)
    for n in range(20):
        pressure.refused(f"run-{n}/0-4095")  # 4,096 ranks a request, 81,920 claimed
    held = sum(len(pressure.heard(f"run-{n}")) for n in range(20))
    assert 0 < held <= 10_000 and len(pressure.heard("run-19")) == 4096


def test_stragglers_and_diverging_are_the_ranks_over_the_line_on_every_step() -> None:
    # Against the definition, over random runs: some ranks missing a step, some over the
    # line on all but one step (the evaluator checks only ranks over it on the newest).
    import random
    import statistics

    from trainwarden.collector.health.step_views import StepView, diverging, stragglers

    rng = random.Random(7)
    for _ in range(300):
        window, ranks = rng.randint(1, 5), rng.randint(3, 40)
        views = {}
        for n in range(rng.randint(window - 1, window + 3)):
            present = [r for r in range(ranks) if rng.random() > 0.05]
            views[n] = StepView(
                ratio={r: rng.choice([1.0, 1.1, 1.3, 2.0]) for r in present},
                z={r: rng.choice([0.0, -7.0, 3.0, 8.0]) for r in present},
                exposed={},
            )
        last = sorted(views)[-window:]
        want_slow = {
            r: statistics.median(views[s].ratio[r] for s in last)
            for r in range(ranks)
            if len(last) == window and all(views[s].ratio.get(r, 0.0) > 1.2 for s in last)
        }
        want_div = {
            r: (statistics.median(views[s].z[r] for s in last), last[0])
            for r in range(ranks)
            if len(last) == window and all(abs(views[s].z.get(r, 0.0)) > 6.0 for s in last)
        }
        assert stragglers(views, ratio=1.2, window=window) == want_slow
        assert diverging(views, z=6.0, window=window) == want_div


def test_a_goodbye_stored_during_a_pass_is_not_overwritten_by_its_verdict(engine) -> None:
    """A pass read rank 1 as healthy and judges it slow; meanwhile its goodbye was stored
    (finished): the verdict is not written over it, nor told as a state change (seen under
    load in the OTLP test: the slow rank ended "slow"). Rank 0's own change is written."""
    from trainwarden.collector.health.writes import write_states

    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i) for i in range(3)], at=T0 + 3)
    with write(engine) as conn:
        read = conn.execute(select(m.ranks).order_by(m.ranks.c.rank)).mappings().all()
        assert [r["state"] for r in read] == ["healthy", "healthy"]
        conn.execute(m.ranks.update().where(m.ranks.c.rank == 1).values(state="finished"))
        verdicts = {0: ("slow", {"compute_ratio": 1.3}), 1: ("slow", {"compute_ratio": 1.4})}
        moved, events = write_states(
            conn, run_id=read[0]["run_id"], ranks=read, states=verdicts, events=[], now=T0 + 4
        )
        after = dict(conn.execute(select(m.ranks.c.rank, m.ranks.c.state)).all())
    assert after == {0: "slow", 1: "finished"}
    assert moved == 1 and [(e["rank"], e["data"]["to"]) for e in events] == [(0, "slow")]


@pytest.mark.parametrize(
    "signalled, ends",
    [(T0 + 16.0, "failed"), (T0 + 15.0, "finished")],
    ids=["hung-before-its-sigterm", "hung-only-in-its-teardown"],
)
def test_a_rank_found_hung_only_after_its_sigterm_was_stalled_by_the_teardown(
    engine, signalled: float, ends: str
) -> None:
    """A preemption: SIGTERM reaches every rank; a rank that waits in a collective for a
    peer that is still flushing (or a slow flush of its own) can be judged hung before its
    goodbye arrives. Found hung before the signal came, it ended hung; found hung only
    after, the teardown stalled it, and it ends as its goodbye says: a preempted job reads
    ``stopped``, not ``failed``."""
    for rank in (0, 1):
        send(engine, rank=rank, steps=[step(i) for i in range(10)], at=T0 + 10)
    send(engine, rank=1, at=T0 + 15.5, in_step=True, phase=None, last_step=9)
    send(engine, rank=0, at=T0 + 15.5, in_step=True, phase="backward", last_step=9)
    assert states(engine, T0 + 15.5)[1][0] == "hung"  # hung since T0 + 15.5
    shutdown = {"kind": "shutdown", "ts": T0 + 17, "step": 9, "data": {"signalled_at": signalled}}
    body = batch(rank=1, world_size=2, events=[{**shutdown, "id": "bye-1"}])
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=T0 + 17)
        state, detail = conn.execute(
            select(m.ranks.c.state, m.ranks.c.state_detail).where(m.ranks.c.rank == 1)
        ).one()
    assert state == ends, (state, detail)
    assert (detail or {}).get("hung_at_end") is (True if ends == "failed" else None)
