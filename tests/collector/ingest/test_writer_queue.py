"""The group-commit writer's queue: many requests per transaction, one bad batch fails
alone, a full or stale queue refuses instead of growing, an event loop's requests
complete in one callback; and the serving process's GC settings."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from trainwarden.collector.ingest.schema_steps import StepIn
from trainwarden.collector.ingest.schemas import AgentInfo, IngestBatch
from trainwarden.collector.ingest.writer import Busy, IngestWriter

from .writer_helpers import node, rows


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
        run="w",
        agent=agent,
        steps=[StepIn.model_construct(step=0, ts=1_700_000_000.0, duration_s=None)],
        events=[],
        gpu=[],
    )
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


def test_a_queue_whose_oldest_request_waited_too_long_refuses_new_ones(engine) -> None:  # type: ignore[no-untyped-def]
    """Past capacity what is accepted stays fresh: once the oldest queued request has
    waited ``max_queue_wait_s``, new ones are refused (the agents keep and resend them);
    the queued ones are still stored."""
    writer = IngestWriter(engine, max_queue_wait_s=1.0)
    gate = threading.Event()
    writer.on_flush = lambda *_: gate.wait(10)
    writer.submit(node(0, range(1)))  # taken by the writer at once, then held
    while writer.pending_rows:
        pass
    queued = [writer.submit(node(8, range(1)))]
    queued.append(writer.submit(node(16, range(1))))  # the oldest has waited < 1 s: taken
    writer._queue[0].arrived -= 1.5  # as if the writer had been busy for 1.5 s
    with pytest.raises(Busy, match=r"the oldest request has waited 1\.\d s"):
        writer.submit(node(24, range(1)))
    gate.set()
    for f in queued:
        f.result(30)
    assert writer.submit(node(24, range(1))).result(30).accepted_steps == 8  # fresh again
    writer.stop()
    assert rows(engine) == 8 * 4


def test_a_flushs_requests_from_an_event_loop_complete_in_one_callback(engine) -> None:  # type: ignore[no-untyped-def]
    # submit_async: the HTTP thread's futures. A flush of many requests wakes their loop
    # once (not a thread-safe call a request), and a bad batch among them still fails
    # alone, with its own error; a cancelled request is skipped.
    writer = IngestWriter(engine)
    gate = threading.Event()
    writer.on_flush = lambda *_: gate.wait(10)
    agent = AgentInfo(rank=16, world_size=64, host="n16", session="s16")
    bad = IngestBatch.model_construct(
        run="w",
        agent=agent,
        steps=[StepIn.model_construct(step=0, ts=1_700_000_000.0, duration_s=None)],
        events=[],
        gpu=[],
    )

    async def main() -> tuple[list[object], int]:
        loop = asyncio.get_running_loop()
        calls = 0
        threadsafe = loop.call_soon_threadsafe

        def counted(*args: object) -> object:
            nonlocal calls
            calls += 1
            return threadsafe(*args)  # type: ignore[arg-type]

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        first = writer.submit_async(node(0, range(1)))  # taken at once, then held
        while writer.pending_rows:
            await asyncio.sleep(0.001)
        gone = writer.submit_async(node(48, range(1)))  # delivered before the others
        gone.cancel()
        held = [writer.submit_async(node(8 * n, range(1))) for n in range(1, 6)]
        refused = writer.submit_async(bad)
        gate.set()
        outcomes = await asyncio.gather(first, *held, refused, return_exceptions=True)
        await asyncio.sleep(0.05)  # the cancelled one's delivery, if any, has run
        return outcomes, calls

    # In a thread of its own: a browser test's Playwright keeps a loop running in the
    # main thread for the rest of the session, and asyncio.run refuses to nest.
    with ThreadPoolExecutor(1) as pool:
        outcomes, calls = pool.submit(asyncio.run, main()).result(60)
    writer.stop()
    assert [o.accepted_steps for o in outcomes[:6]] == [8] * 6  # type: ignore[union-attr]
    assert isinstance(outcomes[6], ValueError) and "the database refused" in str(outcomes[6])
    assert calls == 2  # the first flush, then the other seven requests' flush
    assert rows(engine) == 8 * 7  # the cancelled request was stored all the same


def test_serving_gc_lets_a_burst_of_live_requests_die_before_a_young_collection() -> None:
    """The writer's GC settings (in a fresh interpreter: they are process-wide): startup's
    objects are frozen, and a few hundred thousand containers alive at once (a second of
    requests waiting for their commit, an alert pass's rank rows) start no collection
    (at 16,384 ranks, collections scanning live requests were 15 % of the collector's
    time); garbage cycles are still collected, later."""
    import subprocess
    import sys

    code = """
import gc
from trainwarden.collector.ingest.writer import _settle_gc
_settle_gc()
frozen = gc.get_freeze_count()
young = []
gc.callbacks.append(lambda phase, info: phase == "start" and young.append(info["generation"]))
for _ in range(3):
    held = [{"rank": i, "values": [float(i)]} for i in range(150_000)]  # 300,000 containers
    del held
during = len(young)
for _ in range(1_200_000):  # garbage that only the cyclic GC frees
    a = []
    a.append(a)
    del a
print(frozen, during, len(young))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    frozen, during, after = map(int, out.stdout.split())
    assert frozen > 10_000  # what import left: never scanned again
    assert during == 0  # the bursts died before a collection was due
    assert after >= 1  # cycles still get collected once enough pile up
