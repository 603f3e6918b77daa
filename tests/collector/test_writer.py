"""The group-commit writer: many requests per transaction, one bad batch fails alone,
a full queue refuses instead of growing."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select

from trainwarden.collector import models as m
from trainwarden.collector.schemas import AgentInfo, ColumnarBatch, IngestBatch, StepIn
from trainwarden.collector.writer import Busy, IngestWriter

from .helpers import batch, step


def node(rank0: int, steps: range, *, duration: float = 0.5) -> ColumnarBatch:
    ranks = range(rank0, rank0 + 8)
    cols: dict[str, list[object]] = {"rank": [], "step": [], "ts": [], "duration_s": []}
    for s in steps:
        for r in ranks:
            cols["rank"].append(r)
            cols["step"].append(s)
            cols["ts"].append(1_700_000_000.0 + s)
            cols["duration_s"].append(duration)
    agents = [{"rank": r, "host": f"n{rank0}", "session": f"s{r}"} for r in ranks]
    return ColumnarBatch.model_validate(
        {"run": "w", "world_size": 64, "agents": agents, "steps": cols}
    )


def rows(engine) -> int:  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(m.rank_steps)).scalar_one()


def test_concurrent_requests_share_transactions_and_all_are_stored(engine) -> None:  # type: ignore[no-untyped-def]
    writer = IngestWriter(engine)
    gate = threading.Event()
    futures = []
    # Hold the writer in its first flush so that the next requests gather behind it.
    writer.on_flush = lambda *_: gate.wait(10)
    futures.append(writer.submit(node(0, range(1))))
    for n in range(1, 8):
        futures.append(writer.submit(node(8 * n, range(1))))
    gate.set()
    results = [f.result(30) for f in futures]
    writer.stop()
    assert [r.accepted_steps for r in results] == [8] * 8
    assert rows(engine) == 64
    assert writer.flushes < 8  # some requests were committed together


def test_a_bad_batch_fails_alone_in_its_group(engine) -> None:  # type: ignore[no-untyped-def]
    writer = IngestWriter(engine)
    gate = threading.Event()
    writer.on_flush = lambda *_: gate.wait(10)
    first = writer.submit(node(0, range(1)))
    good = writer.submit(node(8, range(2)))
    # Validated at the edge, yet refused by the database (a step without a duration).
    agent = AgentInfo(rank=16, world_size=64, host="n16", session="s16")
    bad = IngestBatch.model_construct(
        run="w", agent=agent, steps=[StepIn.model_construct(step=0, ts=1_700_000_000.0, duration_s=None)],
        events=[], gpu=[],
    )  # fmt: skip
    refused = writer.submit(bad)
    gate.set()
    assert first.result(30).accepted_steps == 8 and good.result(30).accepted_steps == 16
    with pytest.raises(ValueError, match="the database refused this batch"):
        refused.result(30)
    writer.stop()
    assert rows(engine) == 24


def test_a_full_queue_refuses_new_requests(engine) -> None:  # type: ignore[no-untyped-def]
    writer = IngestWriter(engine, max_pending_rows=40)
    gate = threading.Event()
    writer.on_flush = lambda *_: gate.wait(10)
    writer.submit(node(0, range(1)))  # taken by the writer at once, then held
    while writer.pending_rows:
        pass
    queued = [writer.submit(node(8, range(2))), writer.submit(node(16, range(1)))]  # 24 + 16 rows
    with pytest.raises(Busy, match="rows are waiting"):
        writer.submit(node(24, range(1)))
    gate.set()
    for f in queued:
        f.result(30)
    writer.stop()
    assert rows(engine) == 8 + 16 + 8


def test_one_agents_batch_and_a_node_batch_in_one_flush(engine) -> None:  # type: ignore[no-untyped-def]
    writer = IngestWriter(engine)
    agent = IngestBatch.model_validate(
        {**batch(run="w", rank=63, world_size=64, steps=[step(0), step(1)]),
         "events": [{"id": "e1", "kind": "xid", "ts": 1_700_000_000.0, "severity": "critical"}]}
    )  # fmt: skip
    a, b = writer.submit(agent), writer.submit(node(0, range(2)))
    assert a.result(30).accepted_events == 1 and b.result(30).accepted_steps == 16
    again = writer.submit(agent).result(30)  # replayed: the event is not counted twice
    writer.stop()
    assert again.accepted_events == 0 and rows(engine) == 18
