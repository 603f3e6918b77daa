"""What one flush stores: agent and node batches together, each as it would be alone;
one-row requests keeping their own values; a stale request committed late; the ranks'
rows read by an index probe each and updated on their own page (PostgreSQL)."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import func, select

from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.ingest.writer import IngestWriter
from trainwarden.collector.store import models as m

from ..helpers import batch, step
from .writer_helpers import node, rows


def test_one_agents_batch_and_a_node_batch_in_one_flush(engine) -> None:  # type: ignore[no-untyped-def]
    writer = IngestWriter(engine)
    agent = IngestBatch.model_validate(
        {
            **batch(run="w", rank=63, world_size=64, steps=[step(0), step(1)]),
            "events": [{"id": "e1", "kind": "xid", "ts": 1_700_000_000.0, "severity": "critical"}],
        }
    )
    a, b = writer.submit(agent), writer.submit(node(0, range(2)))
    assert a.result(30).accepted_events == 1 and b.result(30).accepted_steps == 16
    again = writer.submit(agent).result(30)  # replayed: the event is not counted twice
    writer.stop()
    assert again.accepted_events == 0 and rows(engine) == 18


def test_a_ranks_stale_request_committed_late_adds_its_steps_but_not_its_heartbeat(engine) -> None:  # type: ignore[no-untyped-def]
    # Two collectors behind a load balancer: a rank's request that arrived first can
    # commit after the next one (its collector was behind). Here even from the rank's
    # previous process, which had exited.
    from trainwarden.collector.ingest.batches import store_many
    from trainwarden.collector.store.db import write

    def request(session: str, step_no: int) -> IngestBatch:
        body = batch(run="w", rank=3, world_size=8, steps=[step(step_no)], session=session)
        return IngestBatch.model_validate(body)

    with write(engine) as conn:  # the new process's request, arrived at t=200
        store_many(conn, [request("new", 11)], now=200.0, arrived=[200.0])
    with write(engine) as conn:  # the old process's last one, arrived at t=100
        store_many(conn, [request("old", 10)], now=201.0, arrived=[100.0])
    with engine.connect() as conn:
        k, e = m.ranks.c, m.events.c
        rank = conn.execute(select(k.session, k.last_seen, k.last_step).where(k.rank == 3)).one()
        restarts = conn.execute(select(func.count()).where(e.kind == "restart")).scalar_one()
    assert tuple(rank) == ("new", 200.0, 11)  # not put back to the old process, nor step 10
    assert restarts == 0
    assert rows(engine) == 2  # its step is kept

    with write(engine) as conn:  # a request that did come later does update the rank
        store_many(conn, [request("newer", 12)], now=300.0, arrived=[300.0])
    with engine.connect() as conn:
        rank = conn.execute(select(k.session, k.last_seen, k.last_step).where(k.rank == 3)).one()
        restarts = conn.execute(select(func.count()).where(e.kind == "restart")).scalar_one()
    assert tuple(rank) == ("newer", 300.0, 12) and restarts == 1


def test_one_row_requests_of_a_run_in_one_flush_keep_each_rows_own_values(engine) -> None:  # type: ignore[no-untyped-def]
    """A flush's requests of one run are stored as one set of columns (agents with no
    relay send a row a request): a column one request sent and another did not is NULL
    for the other's row, and a non-finite value is named on its own row only."""
    from trainwarden.collector.ingest import batches as ingest
    from trainwarden.collector.store.db import write

    def one(rank: int, **values: object) -> IngestBatch:
        row = {**step(7), "loss": None, **values}
        return IngestBatch.model_validate(batch(run="w", rank=rank, world_size=64, steps=[row]))

    requests = [
        one(0, loss=2.0, metrics={"lr": 0.1}),
        one(1, loss=float("nan")),
        node(2, range(7, 8)),  # ranks 2-9: no loss column at all
        one(10, grad_norm=float("inf"), metrics={"lr": 0.3}),
    ]
    with write(engine) as conn:
        results = ingest.store_many(conn, requests, now=100.0)
    assert [r.accepted_steps for r in results] == [1, 1, 8, 1]
    with engine.connect() as conn:
        c = m.rank_steps.c
        got = conn.execute(
            select(c.rank, c.loss, c.grad_norm, c.metrics, c.issues).order_by(c.rank)
        ).all()
    by_rank = {row.rank: row for row in got}
    assert len(by_rank) == 11
    assert (by_rank[0].loss, by_rank[0].metrics, by_rank[0].issues) == (2.0, {"lr": 0.1}, None)
    assert (by_rank[1].loss, by_rank[1].issues) == (None, {"loss": "nan"})
    assert all(by_rank[r].loss is None and by_rank[r].issues is None for r in range(2, 10))
    assert (by_rank[10].grad_norm, by_rank[10].metrics) == (None, {"lr": 0.3})
    assert by_rank[10].issues == {"grad_norm": "inf"}


def test_a_flush_reads_its_ranks_by_one_index_probe_each_whatever_the_statistics(
    pg_url: str,
) -> None:
    """The ranks a flush holds are read from ``ranks`` by an index probe each. Written
    as ``rank IN (SELECT unnest(:ranks))``, a table without statistics for the run (never
    analyzed, or analyzed before the run existed) got a plan that rescanned the array for
    each of the run's ranks (at 1,024 ranks, 15-40 ms a flush, a third of PostgreSQL's
    time in bench/ingest.py). Here the worst case: a generic plan, no statistics."""
    from sqlalchemy import text

    from trainwarden.collector.ingest import ranks as rk
    from trainwarden.collector.store.db import make_engine

    engine = make_engine(pg_url)
    try:
        with engine.begin() as conn:
            run_id = conn.execute(
                text(
                    "INSERT INTO runs (name, created_at, updated_at, world_size) "
                    "VALUES ('plan-probe', 0, 0, 4096) RETURNING id"
                )
            ).scalar_one()
            conn.execute(
                text(
                    "INSERT INTO ranks (run_id, rank, session, first_seen, last_seen, last_step,"
                    " high_step) SELECT :r, g, 's' || g, 0, 1, g, g + 1 "
                    "FROM generate_series(0, 4095) g"
                ),
                {"r": run_id},
            )
            conn.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))
            wanted = list(range(0, 4096, 7)) + [5000]  # 5000: not a rank of the run
            sql = rk._KNOWN_SQL.bindparams(ranks=wanted, run_id=run_id)
            compiled = sql.compile(dialect=conn.dialect)
            raw = conn.connection.dbapi_connection
            with raw.cursor() as cur:
                cur.execute("EXPLAIN " + str(compiled), compiled.params, prepare=True)
                plan = "\n".join(row[0] for row in cur.fetchall())
            found = rk.known_ranks(conn, run_id, wanted)
            conn.rollback()
    finally:
        engine.dispose()
    assert "Join Filter" not in plan and "Function Scan on unnest" in plan, plan
    assert re.search(r"Index Cond: \(\(run_id = \S+\) AND \(rank = u\.rank\)\)", plan), plan
    assert [row[:2] for row in found] == [(r, f"s{r}") for r in range(0, 4096, 7)]
    assert [row[5] for row in found] == [r + 1 for r in range(0, 4096, 7)]


@pytest.mark.serial
def test_a_heartbeat_updates_its_ranks_row_on_its_own_page(pg_alone_url: str) -> None:
    """Every flush updates each of its ranks' rows. With room left on the page (migration
    0031: fillfactor 50) the new version of a row goes beside the old one, with no new
    index entry (a HOT update) and no growth of the table; at the default fillfactor
    nearly every update moved its row to another page (measured: 0.6 % HOT) and the
    table grew by a copy of its rows a flush until a vacuum.

    Alone (``serial``), on a database of its own, with autovacuum off: a snapshot that
    another connection to the same database holds (an earlier test's server, an autovacuum
    ANALYZE), or a CREATE DATABASE anywhere on the server (another test worker's), keeps
    the versions before it from being pruned, and then the updates move their rows to
    other pages. Checked: with one repeatable-read transaction open on the same database,
    59 % HOT and the table grew by a copy of its rows a flush; with another connection
    creating and dropping databases in a loop, 60 % HOT in 3 runs of 5; alone, 98 % HOT
    and the table 1.13x its first size, every time."""
    from sqlalchemy import text

    from trainwarden.collector.ingest.batches import store_many
    from trainwarden.collector.store.db import make_engine, write

    engine = make_engine(pg_alone_url)

    def no_autovacuum() -> None:  # on every table, the partitions made so far too
        with engine.begin() as conn:
            tables = conn.execute(
                text(
                    "SELECT oid::regclass FROM pg_class WHERE relkind = 'r' AND relnamespace = "
                    "'public'::regnamespace"
                )
            ).scalars()
            for table in tables:
                conn.execute(text(f"ALTER TABLE {table} SET (autovacuum_enabled = off)"))

    no_autovacuum()
    counts = text(
        "SELECT pg_stat_get_xact_tuples_updated('ranks'::regclass), "
        "pg_stat_get_xact_tuples_hot_updated('ranks'::regclass)"
    )
    updated = hot = 0
    sizes = []
    try:
        for step in range(6):
            with write(engine) as conn:
                # This backend's counts not yet reported (this transaction's and earlier
                # ones'): the flush's own updates are the difference.
                before = conn.execute(counts).one()
                store_many(
                    conn,
                    [node(8 * n, range(step, step + 1), run="hot", world=512) for n in range(64)],
                    now=1_700_000_100.0 + step,
                )
                after = conn.execute(counts).one()
                if step:  # the first flush inserted the ranks
                    updated += after[0] - before[0]
                    hot += after[1] - before[1]
            if not step:
                no_autovacuum()  # the day's partitions, made by the first flush
            with engine.connect() as conn:
                sizes.append(conn.execute(text("SELECT pg_relation_size('ranks')")).scalar_one())
        with engine.connect() as conn:
            options = conn.execute(
                text("SELECT reloptions FROM pg_class WHERE relname = 'ranks'")
            ).scalar_one()
    finally:
        engine.dispose()
    assert updated == 5 * 512  # each flush after the first updated each of the 512 ranks
    # Most updates HOT (99 %, the table its size; at the default fillfactor 5 %, the table
    # 5.6x its size after the first flush).
    assert hot >= 0.9 * updated, (hot, updated)
    assert sizes[-1] <= 1.5 * sizes[0], sizes  # the table did not grow a copy a flush
    assert "fillfactor=50" in options


def test_a_flush_stores_agents_batches_as_each_alone_would_be(engine) -> None:  # type: ignore[no-untyped-def]
    """A flush takes a run's agent batches (a request a rank: no relay) as one set of
    columns. What it stores, and each batch's answer, must be what storing the batches one
    flush each gives: the same flush's batches of run "one", one at a time as "alone"."""
    from trainwarden.collector.ingest.batches import store_many
    from trainwarden.collector.store.db import write

    T = 1_700_000_000.0

    def agent(
        run: str,
        rank: int,
        *steps: dict[str, object],
        events: tuple[dict[str, object], ...] = (),
        gpu: tuple[dict[str, object], ...] = (),
    ) -> IngestBatch:
        body = batch(run=run, rank=rank, world_size=16, session=f"s{rank}", steps=list(steps))
        body["events"] = [{**e, "id": f"{run}-{e['id']}"} for e in events]  # ids are unique
        return IngestBatch.model_validate({**body, "gpu": list(gpu)})

    def flush(run: str) -> list[IngestBatch | ColumnarBatch]:
        again = {**step(5), "ts": T + 5.5, "loss": 0.5}  # rank 0 ran step 5 again, later
        xid = {"id": "x", "kind": "xid", "step": 5, "ts": T + 5, "severity": "critical"}
        return [
            agent(run, 0, step(5)),
            agent(run, 1, step(5), events=(xid,), gpu=({"ts": T + 5, "temp_c": 71.0},)),
            agent(run, 9, step(4)),  # a node's rank alone, then its relay back
            node(8, range(5, 7), run=run, world=16),  # a node's relay: ranks 8-15
            agent(run, 0, again),
            agent(run, 2, step(6), step(7)),  # two steps in one request
            agent(run, 3),  # no step: a heartbeat
            agent(f"{run}-other", 0, step(5)),
            agent(run, 1, step(6, loss=float("nan"))),
            agent(run, 8, step(7)),  # a node's rank, sending alone (its relay down)
        ]

    arrived = [T + 10 + i for i in range(10)]
    with write(engine) as conn:
        together = store_many(conn, flush("one"), now=T + 20, arrived=arrived)
    alone = []
    for i, one in enumerate(flush("alone")):
        with write(engine) as conn:
            alone += store_many(conn, [one], now=T + 20, arrived=[arrived[i]])
    assert [(r.accepted_steps, r.accepted_events) for r in together] == [
        (r.accepted_steps, r.accepted_events) for r in alone
    ]
    assert [r.accepted_steps for r in together] == [1, 1, 1, 16, 1, 2, 0, 1, 1, 1]

    def stored(run: str) -> dict[str, list[tuple[object, ...]]]:
        with engine.connect() as conn:
            (rid,) = conn.execute(select(m.runs.c.id).where(m.runs.c.name == run)).one()
            s, r, k, e, g = (
                m.rank_steps.c,
                m.replaced_steps.c,
                m.ranks.c,
                m.events.c,
                m.gpu_samples.c,
            )
            return {
                "steps": conn.execute(
                    select(s.rank, s.step, s.ts, s.duration_s, s.loss, s.issues)
                    .where(s.run_id == rid)
                    .order_by(s.rank, s.step)
                ).all(),
                "replaced": conn.execute(
                    select(r.rank, r.step, r.ts).where(r.run_id == rid).order_by(r.rank, r.step)
                ).all(),
                "ranks": conn.execute(
                    select(k.rank, k.session, k.last_step, k.last_seen)
                    .where(k.run_id == rid)
                    .order_by(k.rank)
                ).all(),
                "events": conn.execute(
                    select(e.rank, e.step, e.kind).where(e.run_id == rid).order_by(e.rank, e.kind)
                ).all(),
                "gpu": conn.execute(
                    select(g.rank, g.ts, g.temp_c).where(g.run_id == rid).order_by(g.rank)
                ).all(),
            }

    one, by_itself = stored("one"), stored("alone")
    assert one == by_itself
    assert stored("one-other")["steps"] == stored("alone-other")["steps"]
    assert len(one["steps"]) == 1 + 2 + 1 + 16 + 2 + 1  # rank 0's step 5 once
    assert one["replaced"] == [(0, 5, T + 5)]  # the earlier execution, kept apart
    ranks = {row[0]: row for row in one["ranks"]}
    assert ranks[0][2:] == (5, T + 14) and ranks[3][2:] == (None, T + 16)
    assert ranks[8][2:] == (7, T + 19)  # its own request, after its node's
    assert ranks[9][2:] == (6, T + 13)  # its node's request, after its own
    assert one["events"] == [(1, 5, "xid")] and one["gpu"] == [(1, T + 5, 71.0)]
