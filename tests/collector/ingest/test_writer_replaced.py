"""Steps run again (a rollback, a replay) in the flushes that store them: new steps
copied straight in, the later execution kept and the earlier one kept as replaced,
within one flush, beside another rank's replay and across midnight."""

from __future__ import annotations

from sqlalchemy import select

from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.store import models as m

from ..helpers import batch, step


def test_new_steps_are_copied_straight_in_and_a_key_stored_meanwhile_falls_back_to_the_upsert(
    engine, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    # The usual flush (steps past each rank's last known one) is COPYed into rank_steps
    # itself, not staged. A row that is there after all (another collector stored it,
    # and this rank's row does not say so yet) makes that COPY fail: it is undone to its
    # savepoint and the upsert decides, keeping the latest execution of the step.
    from sqlalchemy import update

    from trainwarden.collector.ingest import batches as ingest
    from trainwarden.collector.ingest import steps
    from trainwarden.collector.store import bulk
    from trainwarden.collector.store.db import is_sqlite, write

    copied: list[str] = []
    real = bulk.copy_rows

    def spy(conn, table, into, *a):  # type: ignore[no-untyped-def]
        copied.append(into)
        return real(conn, table, into, *a)

    monkeypatch.setattr(bulk, "copy_rows", spy)  # staged upserts
    monkeypatch.setattr(steps, "copy_rows", spy)  # new steps copied straight in

    def request(*steps: dict[str, object]) -> IngestBatch:
        return IngestBatch.model_validate(batch(run="w", rank=3, world_size=8, steps=list(steps)))

    with write(engine) as conn:
        ingest.store_many(conn, [request(step(5), step(6))], now=100.0)
    with write(engine) as conn:  # as if another collector's rank row had been written over
        conn.execute(update(m.ranks).values(last_step=4))
    again = {**step(6, loss=0.5), "ts": 1_700_000_100.0}  # step 6 run again after a rollback
    with write(engine) as conn:
        ingest.store_many(conn, [request(again, step(7))], now=200.0)
    with engine.connect() as conn:
        c = m.rank_steps.c
        stored = conn.execute(select(c.step, c.loss).order_by(c.step)).all()
        queued = conn.execute(
            select(m.rollup_queue.c.step, m.rollup_queue.c.seen_n).order_by(m.rollup_queue.c.step)
        ).all()
    assert [tuple(r) for r in stored] == [(5, 1.0), (6, 0.5), (7, 1.0)]
    assert [tuple(r) for r in queued] == [(5, 1), (6, 2), (7, 1)]
    if not is_sqlite(engine):
        assert [t for t in copied if "rank_steps" in t] == [
            "rank_steps",
            "rank_steps",
            "tw_stage_rank_steps",
        ]


def test_a_step_run_twice_within_one_flush_keeps_the_later_and_the_earlier_as_replaced(
    engine,
) -> None:  # type: ignore[no-untyped-def]
    # Under load a rank's first execution of steps and, after a rollback, its second can
    # wait in the same flush: the later one is stored, the earlier kept as replaced.
    from trainwarden.collector.ingest import batches as ingest
    from trainwarden.collector.store.db import write

    def request(*steps: dict[str, object]) -> IngestBatch:
        return IngestBatch.model_validate(batch(run="w", rank=3, world_size=8, steps=list(steps)))

    first = [{**step(s, loss=9.0), "ts": 1_700_000_000.0 + s} for s in (5, 6)]
    again = [{**step(s, loss=1.0), "ts": 1_700_000_100.0 + s} for s in (5, 6)]
    with write(engine) as conn:  # the first execution replayed too (a retry after a timeout)
        ingest.store_many(
            conn, [request(*first), request(*first), request(*again), request(*again)], now=100.0
        )
    with engine.connect() as conn:
        c, r = m.rank_steps.c, m.replaced_steps.c
        stored = conn.execute(select(c.step, c.loss).order_by(c.step)).all()
        replaced = conn.execute(select(r.step, r.loss, r.replaced_at).order_by(r.step)).all()
    assert [tuple(x) for x in stored] == [(5, 1.0), (6, 1.0)]
    assert [tuple(x) for x in replaced] == [(5, 9.0, 100.0), (6, 9.0, 100.0)]  # once each


def test_a_rollbacks_later_steps_in_a_flush_with_another_ranks_replay_are_kept_as_replaced(
    engine,
) -> None:  # type: ignore[no-untyped-def]
    # After a rollback each rank's last step goes back with its first steps run again. A
    # rank whose next steps (past that new last step, but stored once already) share a
    # flush with another rank's first steps run again must have its earlier executions
    # kept as replaced too, not written over (seen in CI: 2 of 4 ranks' steps missing).
    from trainwarden.collector.ingest import batches as ingest
    from trainwarden.collector.store.db import write

    def request(rank: int, steps: range, *, t0: float, loss: float) -> IngestBatch:
        return IngestBatch.model_validate(
            batch(
                run="w",
                rank=rank,
                world_size=8,
                steps=[{**step(s, loss=loss), "ts": t0 + s} for s in steps],
            )
        )

    first, again = 1_700_000_000.0, 1_700_000_100.0
    with write(engine) as conn:  # both ranks ran steps 0-5
        ingest.store_many(
            conn, [request(r, range(6), t0=first, loss=9.0) for r in (0, 1)], now=10.0
        )
    with write(engine) as conn:  # rank 1 rolled back to 0 and sends 1-2 again first
        ingest.store_many(conn, [request(1, range(1, 3), t0=again, loss=1.0)], now=20.0)
    with write(engine) as conn:  # then rank 0's 1-2 again and rank 1's 3-4 again, one flush
        ingest.store_many(
            conn,
            [
                request(0, range(1, 3), t0=again, loss=1.0),
                request(1, range(3, 5), t0=again, loss=1.0),
            ],
            now=30.0,
        )
    with engine.connect() as conn:
        c, r = m.rank_steps.c, m.replaced_steps.c
        stored = conn.execute(select(c.rank, c.step, c.loss).order_by(c.rank, c.step)).all()
        replaced = conn.execute(select(r.rank, r.step, r.loss).order_by(r.rank, r.step)).all()
    assert [tuple(x) for x in stored] == [
        (0, 0, 9.0),
        (0, 1, 1.0),
        (0, 2, 1.0),
        (0, 3, 9.0),
        (0, 4, 9.0),
        (0, 5, 9.0),
        (1, 0, 9.0),
        (1, 1, 1.0),
        (1, 2, 1.0),
        (1, 3, 1.0),
        (1, 4, 1.0),
        (1, 5, 9.0),
    ]
    assert [tuple(x) for x in replaced] == [
        (0, 1, 9.0),
        (0, 2, 9.0),
        (1, 1, 9.0),
        (1, 2, 9.0),
        (1, 3, 9.0),
        (1, 4, 9.0),
    ]


def test_steps_run_again_after_midnight_replace_those_of_the_day_before(engine) -> None:  # type: ignore[no-untyped-def]
    # rank_steps is partitioned by day, so a step run again on the next day (a rollback
    # across midnight UTC) has a key of its own: no unique violation tells the COPY of new
    # steps that it was stored already. Every step up to the rank's highest ever stored
    # is looked up, whatever its last step says now.
    from trainwarden.collector.ingest import batches as ingest
    from trainwarden.collector.store.db import write

    midnight = 1_700_006_400.0  # 2023-11-15 00:00 UTC: day_of changes here

    def request(steps: range, *, t0: float, loss: float) -> IngestBatch:
        return IngestBatch.model_validate(
            batch(
                run="w",
                rank=0,
                world_size=1,
                steps=[{**step(s, loss=loss), "ts": t0 + s} for s in steps],
            )
        )

    with write(engine) as conn:  # steps 0-5 just before midnight
        ingest.store_many(conn, [request(range(6), t0=midnight - 10, loss=9.0)], now=10.0)
    for steps in (range(1, 3), range(3, 5)):  # rolled back to 0: run again after it
        with write(engine) as conn:
            ingest.store_many(conn, [request(steps, t0=midnight + 60, loss=1.0)], now=20.0)
    with engine.connect() as conn:
        c, r = m.rank_steps.c, m.replaced_steps.c
        stored = conn.execute(select(c.step, c.loss).order_by(c.step, c.day)).all()
        replaced = conn.execute(select(r.step, r.loss).order_by(r.step)).all()
    assert [tuple(x) for x in stored] == [
        (0, 9.0),
        (1, 1.0),
        (2, 1.0),
        (3, 1.0),
        (4, 1.0),
        (5, 9.0),
    ]
    assert [tuple(x) for x in replaced] == [(s, 9.0) for s in range(1, 5)]
