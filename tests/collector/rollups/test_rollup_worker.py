"""Steps are rolled up once they are complete, or after a grace period; late ranks count."""

from __future__ import annotations

import itertools

from sqlalchemy import func, select

from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.rollups.worker import flush, roll_up_ready
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step

T0 = 1_700_000_000.0


def send(engine, rank: int, steps: list[int], at: float, world: int = 3) -> None:  # type: ignore[no-untyped-def]
    body = batch(rank=rank, world_size=world, steps=[step(i, loss=float(rank)) for i in steps])
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=at)


def loss_stats(engine) -> dict[int, tuple[int, float]]:  # type: ignore[no-untyped-def]
    s = m.step_stats.c
    with engine.connect() as conn:
        rows = conn.execute(select(s.step, s.n, s.max).where(s.metric == "loss")).all()
    return {step: (n, top) for step, n, top in rows}


def waiting(engine) -> set[int]:  # type: ignore[no-untyped-def]
    """Steps queued and not rolled up yet."""
    q = m.rollup_queue.c
    with engine.connect() as conn:
        return set(conn.execute(select(q.step).where(q.rolled_n.is_(None))).scalars())


def test_a_complete_step_rolls_up_at_once_an_incomplete_one_waits_for_grace(engine) -> None:
    for rank in range(3):
        send(engine, rank, [0, 1] if rank < 2 else [0], at=T0)
    assert flush(engine, now=T0 + 0.1, grace_s=5) == 1  # step 0 complete; step 1 lacks rank 2
    assert loss_stats(engine) == {0: (3, 2.0)}
    assert waiting(engine) == {1}
    assert flush(engine, now=T0 + 5.1, grace_s=5) == 1  # grace over: roll up what is there
    assert loss_stats(engine)[1] == (2, 1.0)
    assert waiting(engine) == set()
    assert flush(engine, now=T0 + 5.2, grace_s=5) == 0  # nothing changed: no work
    flush(engine, now=T0 + 100)  # settled: the queue empties
    with engine.connect() as conn:
        assert conn.execute(select(m.rollup_queue.c.step)).all() == []


def test_an_incomplete_step_waits_while_its_rows_still_arrive(engine) -> None:
    send(engine, 0, [0], at=T0)
    send(engine, 1, [0], at=T0 + 4)  # a collector running behind wrote rank 1's row late
    assert flush(engine, now=T0 + 6, grace_s=5) == 0  # rows came 2 s ago: more may follow
    send(engine, 2, [0], at=T0 + 7)
    assert flush(engine, now=T0 + 7.1, grace_s=5) == 1  # complete: rolled up once, whole
    assert loss_stats(engine)[0] == (3, 2.0)
    assert flush(engine, now=T0 + 20, grace_s=5) == 0


def test_a_late_rank_is_rolled_in_again(engine) -> None:
    for rank in range(2):
        send(engine, rank, [0], at=T0)
    flush(engine, now=T0 + 6, grace_s=5)
    assert loss_stats(engine)[0] == (2, 1.0)
    send(engine, 2, [0], at=T0 + 7)  # rank 2 was late
    flush(engine, now=T0 + 7.1, grace_s=5)
    assert loss_stats(engine)[0] == (3, 2.0)


def test_a_replayed_batch_changes_nothing_and_a_changed_replay_is_rolled_again(engine) -> None:
    for rank in range(3):
        send(engine, rank, [0, 1], at=T0)
    flush(engine, now=T0 + 1)
    before = loss_stats(engine)
    send(engine, 1, [0, 1], at=T0 + 2)  # the same rows again
    assert flush(engine, now=T0 + 3) == 0  # stored rows unchanged: nothing to roll again
    assert loss_stats(engine) == before
    rerun = {**step(1, loss=9.0), "ts": T0 + 3.5}  # a restart runs step 1 again, later
    body = batch(rank=2, world_size=3, steps=[rerun])
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=T0 + 4)
    flush(engine, now=T0 + 5)
    assert loss_stats(engine)[1] == (3, 9.0)


def test_heatmap_from_bucket_maxima_equals_the_one_from_raw_rows(engine) -> None:
    from trainwarden.collector.read.series import heatmap

    rng = __import__("random").Random(3)
    for rank in range(4):
        body = batch(
            rank=rank,
            world_size=4,
            steps=[
                step(i, duration=(0.3 if rank == 2 else 0.1) + rng.random() / 100)
                for i in range(640)
            ],
        )
        with write(engine) as conn:
            ingest(conn, batch=IngestBatch.model_validate(body), now=T0)
    flush(engine, now=T0 + 1)
    with engine.connect() as conn:
        fast = heatmap(conn, run="r1", metric="step_time", buckets=10)
        slow = heatmap(conn, run="r1", metric="step_time", buckets=10, use_rollups=False)
        wide = heatmap(conn, run="r1", metric="step_time", buckets=2)  # 320 steps: the 256 level
        stored = conn.execute(select(m.bucket_maxima.c.level).distinct()).scalars().all()
    assert sorted(stored) == [16, 64, 256]  # 640 steps close 40, 10 and 2 buckets
    assert fast.bucket == slow.bucket == 64 and fast.step_start == slow.step_start
    assert fast.ranks == slow.ranks == [0, 1, 2, 3]
    assert fast.values == slow.values
    assert all(v > 0.3 for v in fast.values[2]) and all(v < 0.2 for v in fast.values[0])
    assert wide.bucket == 512 and len(wide.step_start) == 2
    assert wide.values[2][0] == max(fast.values[2][:8])


def test_bucket_maxima_rolled_up_piecewise_with_gaps_match_raw_rows(engine) -> None:  # type: ignore[no-untyped-def]
    """Steps arrive and roll up in uneven pieces, some steps never come, the last bucket
    is still open: the heatmap from stored maxima plus the raw edge equals the raw one."""
    from trainwarden.collector.read.series import heatmap

    rng = __import__("random").Random(5)
    steps = [i for i in range(2_900) if not 100 <= i < 140 and i != 2_063]
    cuts = [0, 7, 300, 301, 1_000, 2_050, 2_700, len(steps)]
    for a, b in itertools.pairwise(cuts):
        for rank in range(3):
            body = batch(
                rank=rank, world_size=3, steps=[step(i, duration=rng.random()) for i in steps[a:b]]
            )
            with write(engine) as conn:
                ingest(conn, batch=IngestBatch.model_validate(body), now=T0)
        flush(engine, now=T0 + 1)
    s = m.rank_steps.c
    with engine.connect() as conn:
        raw = conn.execute(select(s.rank, s.step, s.duration_s)).all()
        for buckets in (7, 40, 181):
            fast = heatmap(conn, run="r1", metric="step_time", buckets=buckets)
            expected = [[None] * len(fast.step_start) for _ in range(3)]
            for rank, at, value in raw:  # the max per rank and cell, by hand
                cell = (at - fast.step_start[0]) // fast.bucket
                if expected[rank][cell] is None or value > expected[rank][cell]:
                    expected[rank][cell] = value
            assert fast.values == expected, (buckets, fast.bucket)
        assert heatmap(conn, run="r1", metric="step_time", buckets=7).bucket == 512  # the 256 level
        late = heatmap(conn, run="r1", metric="step_time", buckets=3, from_step=2_600)
        assert late.values and all(v is not None for row in late.values for v in row)


def test_the_frequent_pass_goes_by_the_rows_ingest_counted_and_the_recheck_by_the_rows(
    engine,
) -> None:
    for rank in range(3):
        send(engine, rank, [0, 1] if rank < 2 else [0], at=T0)
    q = m.rollup_queue.c
    with engine.connect() as conn:
        counted = conn.execute(select(q.step, q.seen_n, q.newest).order_by(q.step)).all()
    assert [tuple(row) for row in counted] == [(0, 3, T0), (1, 2, T0)]
    with write(engine) as conn:
        assert roll_up_ready(conn, now=T0 + 0.1, grace_s=5, recheck=False) == 1  # step 0: 3 of 3
    assert loss_stats(engine) == {0: (3, 2.0)}
    send(engine, 1, [1], at=T0 + 3)  # a replay: counted again (3 of 3), and its time is the newest
    with write(engine) as conn:
        assert conn.execute(select(q.seen_n).where(q.step == 1)).scalar() == 3
        assert roll_up_ready(conn, now=T0 + 5.1, grace_s=5, recheck=False) == 0  # 2 rows in fact
        assert (
            roll_up_ready(conn, now=T0 + 8.1, grace_s=5, recheck=False) == 1
        )  # the last: grace over
    assert loss_stats(engine)[1] == (2, 1.0)
    send(engine, 2, [1], at=T0 + 9)  # late for a rolled-up step: the recheck's to find
    with write(engine) as conn:
        assert roll_up_ready(conn, now=T0 + 9.1, grace_s=5, recheck=False) == 0
        assert roll_up_ready(conn, now=T0 + 9.2, grace_s=5, recheck=True) == 1
    assert loss_stats(engine)[1] == (3, 2.0)


def test_the_recheck_counts_only_steps_ingest_wrote_to_since_their_rollup(engine) -> None:
    for rank in range(3):
        send(engine, rank, [0, 1], at=T0)
    with write(engine) as conn:
        assert roll_up_ready(conn, now=T0 + 0.1, grace_s=5, recheck=False) == 2
    # Rows that leave behind ingest's back (not a thing trainwarden does) show which steps
    # the recheck counts: neither step has had a write since its rollup, so neither is.
    r = m.rank_steps.c
    with write(engine) as conn:
        conn.execute(m.rank_steps.delete().where(r.rank == 0))
        assert roll_up_ready(conn, now=T0 + 1, grace_s=5, recheck=True) == 0
    assert loss_stats(engine) == {0: (3, 2.0), 1: (3, 2.0)}
    send(engine, 1, [1], at=T0 + 2)  # a replay into step 1: now step 1 is counted again
    with write(engine) as conn:
        assert roll_up_ready(conn, now=T0 + 2.1, grace_s=5, recheck=True) == 1
    assert loss_stats(engine) == {0: (3, 2.0), 1: (2, 2.0)}


def test_the_recheck_reads_the_queued_steps_by_key_not_the_days_rows(pg_url: str) -> None:
    """PostgreSQL's plan for the recheck's count: by each queued step's key, not a scan of
    the day's partition (as a join it hashed every row of the day against the queue: 0.8 s
    a call after 4 minutes at 16,384 ranks, and more as the day went on). Checked on
    300 steps x 512 ranks with 10 steps queued: the rows read are those 10 steps'."""
    from sqlalchemy import text
    from sqlalchemy.dialects import postgresql

    from trainwarden.collector.rollups.worker import due_query
    from trainwarden.collector.store.db import make_engine
    from trainwarden.collector.store.partitions import day_of, ensure_partitions

    engine = make_engine(pg_url)
    ensure_partitions(engine, {day_of(T0)})
    with write(engine) as conn:
        conn.execute(text("TRUNCATE runs, rank_steps, rollup_queue RESTART IDENTITY CASCADE"))
        conn.execute(
            text(
                "INSERT INTO runs (name, created_at, updated_at, world_size) "
                "VALUES ('big', :t, :t, 512)"
            ),
            {"t": T0},
        )
        conn.execute(
            text(
                "INSERT INTO rank_steps (run_id, step, rank, day, ts, recv_ts, duration_s) "
                "SELECT 1, s, r, :day, :t + s, :t + s, 1.0 "
                "FROM generate_series(0, 299) s, generate_series(0, 511) r"
            ),
            {"day": day_of(T0), "t": T0},
        )
        conn.execute(
            text(
                "INSERT INTO rollup_queue "
                "(run_id, step, first_seen, seen_n, newest, rolled_n, rolled_at) "
                "SELECT 1, s, :t + s, 513, :t + s, 512, :t + s FROM generate_series(290, 299) s"
            ),
            {"t": T0},
        )
    with engine.connect() as conn:
        conn.execute(text("ANALYZE rank_steps"))
        conn.execute(text("ANALYZE rollup_queue"))
        # Whatever join the planner would pick: it picked a hash join over the whole
        # partition when its estimates were off, which this forces.
        conn.execute(text("SET enable_nestloop = off"))
        sql = due_query(True).compile(
            dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}
        )
        plan = conn.execute(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")).scalar_one()

        def read(node: dict) -> int:  # rows the plan read from rank_steps' partitions
            own = node["Actual Rows"] * node["Actual Loops"]
            mine = own if node.get("Relation Name", "").startswith("rank_steps") else 0
            return mine + sum(read(child) for child in node.get("Plans", []))

        queued = 10 * 512
        assert queued <= read(plan[0]["Plan"]) <= 2 * queued  # of 153,600 rows
        rows = conn.execute(due_query(True)).all()
        conn.execute(text("RESET enable_nestloop"))
    assert [(row.step, row.n) for row in rows] == [(s, 512) for s in range(290, 300)]
    with write(engine) as conn:  # the session's database is shared: leave it empty
        conn.execute(text("TRUNCATE runs, rank_steps, rollup_queue RESTART IDENTITY CASCADE"))
    engine.dispose()


def test_bucket_maxima_of_every_heatmap_metric_are_each_ranks_maxima(engine) -> None:  # type: ignore[no-untyped-def]
    """One pass computes every heatmap metric's maxima: each stored under its own name,
    none for a rank that never reported the metric in the bucket (NULLs, a NaN loss)."""
    from trainwarden.collector.rollups.worker import HEATMAP_COLUMNS

    rng = __import__("random").Random(5)
    sent: dict[tuple[str, int, int], list[float]] = {}  # (metric, rank, bucket) -> values
    for rank in range(3):
        steps = []
        for i in range(32):
            row = step(i, duration=rng.random(), loss="nan" if rank == 2 else rng.random())
            row["data_wait_s"] = rng.random() / 10
            if rank != 1:  # rank 1 sends no communication split
                row.update(compute_s=rng.random() / 2, exposed_comm_s=rng.random() / 5)
            steps.append(row)
            for metric, column in HEATMAP_COLUMNS.items():
                value = row.get(column)
                if isinstance(value, float):
                    sent.setdefault((metric, rank, i // 16), []).append(value)
        with write(engine) as conn:
            ingest(
                conn,
                batch=IngestBatch.model_validate(batch(rank=rank, world_size=3, steps=steps)),
                now=T0,
            )
    flush(engine, now=T0 + 1)
    k = m.bucket_maxima.c
    with engine.connect() as conn:
        stored = conn.execute(
            select(k.metric, k.bucket, k.ranks, k.maxima).where(k.level == 16)
        ).all()
    expected = {key: max(values) for key, values in sent.items()}
    assert all(ranks == sorted(ranks) for _, _, ranks, _ in stored)  # in rank order
    assert {
        (metric, rank, bucket): top
        for metric, bucket, ranks, maxima in stored
        for rank, top in zip(ranks, maxima, strict=True)
    } == expected
    assert ("compute", 1, 0) not in expected and ("loss", 2, 0) not in expected  # not vacuous
    # 2 buckets of: step time and data wait of 3 ranks, loss, compute and exposed comm of 2
    assert len(expected) == 2 * (3 + 3 + 2 + 2 + 2)


def test_a_steps_rollup_is_queryable_before_its_heatmap_bucket_is_written(
    engine, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # A 16-step bucket's maxima at 16,384 ranks take a second: the steps' rollups are
    # committed before that work starts, not held back by it.
    from trainwarden.collector.rollups import worker as rollup_worker

    seen_then: list[int] = []
    real = rollup_worker._bucket_maxima

    def watched(conn, groups):  # type: ignore[no-untyped-def]
        with engine.connect() as other:  # another session: what the series API sees
            seen_then.append(
                other.execute(select(func.count(func.distinct(m.step_stats.c.step)))).scalar_one()
            )
        real(conn, groups)

    monkeypatch.setattr(rollup_worker, "_bucket_maxima", watched)
    for rank in range(2):
        send(engine, rank=rank, world=2, steps=list(range(17)), at=T0 + 20)
    assert flush(engine, now=T0 + 100) == 17
    assert seen_then == [17]  # every step's rollup already visible
    with engine.connect() as conn:  # and the bucket was written after them
        k = m.bucket_maxima.c
        assert (
            conn.execute(select(func.count()).where(k.level == 16, k.bucket == 0)).scalar_one() > 0
        )
