"""db: the hot reads' rows (fetch_rows, the same as SQLAlchemy's on SQLite and PostgreSQL), and a
PostgreSQL session hung inside a transaction ended by the server."""

from __future__ import annotations

import math

import pytest
from sqlalchemy import func, select, update

from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import fetch_rows, write

from ..helpers import batch, step


def test_fetch_rows_reads_what_sqlalchemy_reads(engine) -> None:  # type: ignore[no-untyped-def]
    """Integers past 32 bits, floats to the last bit, NULLs, text, a JSON field read as
    text, an expression, an IN list and an array parameter: the same tuples either way."""
    for rank in range(3):
        steps = [step(n, loss=None if n == 2 else 1 / 3 + n * 1e-12) for n in range(4)]
        body = batch(rank=rank, world_size=3, steps=steps)
        for s in body["steps"]:
            s["tokens"] = 2**40 + s["step"]
        with write(engine) as conn:
            ingest(conn, batch=IngestBatch.model_validate(body))
    with write(engine) as conn:
        conn.execute(update(m.ranks).where(m.ranks.c.rank == 1).values(gpu={"uuid": "GPU-1"}))
    r, k = m.rank_steps.c, m.ranks.c
    with engine.connect() as conn:  # the run's id: not assumed (another test's leftovers)
        run_id = conn.execute(select(m.runs.c.id).where(m.runs.c.name == "r1")).scalar_one()
    queries = [
        select(r.rank, r.step, r.ts, r.loss, r.tokens, func.coalesce(r.loss, r.duration_s))
        .where(r.run_id == run_id, r.step.in_([1, 2, 3]), r.step.not_in([3]))
        .order_by(r.step, r.rank),
        select(k.rank, k.host, k.gpu["uuid"].as_string(), k.session, k.last_step)
        .where(k.run_id == run_id)
        .order_by(k.rank),
        select(r.rank, r.step).where(r.run_id == run_id + 1),  # nothing
    ]
    with engine.connect() as conn:
        for query in queries:
            expected = [tuple(row) for row in conn.execute(query)]
            got = fetch_rows(conn, query)
            assert got == expected
            assert all(type(row) is tuple for row in got)
            for row, want in zip(got, expected, strict=True):
                assert [type(v) for v in row] == [type(v) for v in want]
        # Not vacuous: the rows are there, with what was stored.
        steps = fetch_rows(conn, queries[0])
        assert len(steps) == 6 and {row[4] for row in steps} == {2**40 + 1, 2**40 + 2}
        assert [row[3] for row in steps if row[1] == 1] == [1 / 3 + 1e-12] * 3
        assert [row[2] for row in fetch_rows(conn, queries[1])] == [None, "GPU-1", None]


def test_json_columns_parse_with_orjson_and_what_it_refuses_with_the_standard_library() -> None:
    from trainwarden.collector.store.db import json_loads

    assert json_loads(b'{"rank": 3, "labels": {"run": "r1"}}') == {
        "rank": 3,
        "labels": {"run": "r1"},
    }
    value = json_loads(
        '{"loss": NaN, "big": 123456789012345678901234567890}'
    )  # orjson refuses both
    assert math.isnan(value["loss"]) and value["big"] == 123456789012345678901234567890
    with pytest.raises(ValueError):
        json_loads(b"{not json")


def test_a_collector_hung_inside_a_pass_loses_its_lock_to_the_others(pg_url: str) -> None:
    """A collector stopped in the middle of a pass (between two statements of its
    transaction) holds the pass's advisory lock until PostgreSQL ends its session, after
    ``idle_in_transaction_s``; then another collector takes the lock and the pass. The
    hung one's next statement fails (its pool replaces the connection)."""
    import time

    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    from trainwarden.collector.rollups.worker import ADVISORY_LOCK_KEY
    from trainwarden.collector.store.db import make_engine

    hung, other = make_engine(pg_url, idle_in_transaction_s=1.0), make_engine(pg_url)
    take = text("SELECT pg_try_advisory_xact_lock(:k)").bindparams(k=ADVISORY_LOCK_KEY)
    try:
        with hung.connect() as stuck:
            stuck.begin()
            assert stuck.execute(take).scalar() is True
            with other.begin() as conn:
                assert conn.execute(take).scalar() is False  # held: this pass is skipped
            deadline, taken = time.monotonic() + 30, False
            while not taken and time.monotonic() < deadline:
                with other.begin() as conn:
                    taken = bool(conn.execute(take).scalar())
                time.sleep(0.2)
            assert taken, "the hung session kept the lock"
            with pytest.raises(DBAPIError):
                stuck.execute(text("SELECT 1"))
    finally:
        hung.dispose()
        other.dispose()
