"""Group commit: one writer thread stores every pending ingest request in one transaction.

A request handler validates its body, hands the batch to :class:`IngestWriter` and
waits for the transaction that holds it to commit, so an answered request is durable
and a failed one can be retried. While one transaction runs, new requests gather; the
next takes them all. Under load a transaction carries hundreds of requests, so the
per-statement and per-commit costs are paid per flush, not per request — this is what
lets one collector process take thousands of ranks (see bench/ingest.py).

The queue is bounded in rows: past ``max_pending_rows`` a request is refused at once
(``Busy`` → 503 + Retry-After), so a slow database slows the agents down instead of
growing the collector's memory; and in time: once the oldest queued request has waited
``max_queue_wait_s`` for its flush, new ones are refused too, so that past capacity what
is accepted stays fresh (the refused wait in the agents' spools).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError

from trainwarden.collector.ingest.batch_columns import batch_rows
from trainwarden.collector.ingest.batches import store_many
from trainwarden.collector.ingest.ranks import forget_runs
from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schemas import IngestBatch, IngestResult
from trainwarden.collector.store.db import write
from trainwarden.collector.store.partitions import forget_partitions

log = logging.getLogger(__name__)


# Python's cyclic GC, tuned once per process for serving (see _settle_gc).
GC_THRESHOLDS = (1_000_000, 20, 20)  # default (700, 10, 10)
_gc_settled = False


def _settle_gc() -> None:
    """Freeze what startup built and collect the young generation rarely.

    Measured at 4,096 ranks (bench/ingest.py): with the defaults the collector spent
    about 40 % of its CPU in the GC: ~200 young collections a second, each scanning
    the requests that wait for their commit, and a full collection every ~0.6 s that
    walked the ~160,000 objects startup leaves (FastAPI, SQLAlchemy, Dash, plotly, ...),
    which never become garbage. Frozen, they are skipped.

    A young collection starts when the containers allocated since the last one, less
    those freed, pass the first threshold. A second of requests in flight, or one alert
    pass's rank rows, holds a few hundred thousand: at 100,000 (until 2026-11-25) a
    collection came 2-3 times a second at 16,384 ranks, each 50-75 ms scanning live
    requests, 15 % of the collector's time. At 1,000,000 the in-flight objects die
    before one is due: one collection in two minutes at 16,384 ranks (0.28 s; it found
    7,311 unreachable objects), the memory held steady (530 MB), and rows/s rose 5 %.
    A service that makes little cyclic garbage (this one) can afford the wait."""
    global _gc_settled
    if _gc_settled:
        return
    _gc_settled = True
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class Busy(Exception):
    """The writer's queue is full: the request is refused, nothing was stored."""


@dataclass
class _Pending:
    batch: IngestBatch | ColumnarBatch
    rows: int
    # A thread's future (submit), or an event loop's (submit_async, with its loop).
    future: Future[IngestResult] | asyncio.Future[IngestResult]
    arrived: float  # wall time: a rank's heartbeat is when its request came in
    loop: asyncio.AbstractEventLoop | None = None
    result: IngestResult | None = None
    error: BaseException | None = None

    @property
    def settled(self) -> bool:
        return self.result is not None or self.error is not None


def _settle(items: list[_Pending]) -> None:
    """Complete the requests' futures with their outcomes: in the writer thread for
    :meth:`IngestWriter.submit`'s, in their event loop (one call a flush) for
    :meth:`IngestWriter.submit_async`'s."""
    for item in items:
        future = item.future
        if future.done():  # cancelled: the request's client went away
            continue
        if item.error is not None:
            future.set_exception(item.error)
        else:
            future.set_result(item.result)  # type: ignore[arg-type]


class IngestWriter:
    def __init__(
        self,
        engine: Engine,
        *,
        max_pending_rows: int = 100_000,
        max_flush_rows: int = 50_000,
        max_queue_wait_s: float | None = None,
        on_flush: Any = None,
    ) -> None:
        self.engine = engine
        self.max_pending_rows = max_pending_rows
        # Past capacity, what is accepted must stay fresh: a request is refused once the
        # oldest one queued has waited this long for its flush (None: no bound).
        self.max_queue_wait_s = max_queue_wait_s
        self.max_flush_rows = max_flush_rows
        self.on_flush = on_flush  # (requests, rows, seconds) after each committed flush
        self._cond = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._rows = 0
        # One thread: two, tried, deadlocked on PostgreSQL when a node's consecutive
        # requests landed in concurrent flushes, and were not faster.
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._writing_since: float | None = None  # arrival of the oldest request being written
        self.flushes = 0

    @property
    def pending_rows(self) -> int:
        return self._rows

    def lag_s(self, now: float | None = None) -> float:
        """How long the oldest request not yet committed has waited (0 when none)."""
        with self._cond:
            oldest = [
                t
                for t in (self._writing_since, self._queue[0].arrived if self._queue else None)
                if t is not None
            ]
        return max(0.0, (time.time() if now is None else now) - min(oldest)) if oldest else 0.0

    def submit(self, batch: IngestBatch | ColumnarBatch) -> Future[IngestResult]:
        """Queue ``batch``; the future completes when it is committed (or failed)."""
        future: Future[IngestResult] = Future()
        self._enqueue(batch, future, None)
        return future

    def submit_async(self, batch: IngestBatch | ColumnarBatch) -> asyncio.Future[IngestResult]:
        """:meth:`submit` from a coroutine: an asyncio future of the running loop. A
        flush completes all of a loop's futures in one callback (not one thread-safe
        call, and one wake-up of the loop, a request: the HTTP thread's cost a request)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[IngestResult] = loop.create_future()
        self._enqueue(batch, future, loop)
        return future

    def _enqueue(self, batch: IngestBatch | ColumnarBatch, future: Any, loop: Any) -> None:
        rows = batch_rows(batch)
        with self._cond:
            if self._stopping:
                raise Busy("collector is shutting down")
            if self._queue and self._rows + rows > self.max_pending_rows:
                raise Busy(f"{self._rows:,} rows are waiting to be written")
            now = time.time()
            wait = self.max_queue_wait_s
            if wait is not None and self._queue and now - self._queue[0].arrived > wait:
                raise Busy(
                    f"the oldest request has waited {now - self._queue[0].arrived:.1f} s "
                    "to be written"
                )
            self._queue.append(_Pending(batch, rows, future, now, loop))
            self._rows += rows
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="trainwarden-writer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _take(self) -> list[_Pending] | None:
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if not self._queue:
                return None
            group: list[_Pending] = []
            rows = 0
            while self._queue and (not group or rows + self._queue[0].rows <= self.max_flush_rows):
                item = self._queue.popleft()
                group.append(item)
                rows += item.rows
            self._rows -= rows
            self._writing_since = min(item.arrived for item in group)
            return group

    def _run(self) -> None:
        _settle_gc()
        while (group := self._take()) is not None:
            try:
                self._write(group)
            except BaseException as exc:  # never leave a request waiting forever
                log.exception("ingest writer failed")
                for item in group:
                    if not item.settled:
                        item.error = exc
            self._writing_since = None
            self._deliver(group)

    @staticmethod
    def _deliver(group: list[_Pending]) -> None:
        """Hand each request its outcome: a thread's future at once, an event loop's
        futures together, in one callback a loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Pending]] = {}
        for item in group:
            if item.loop is not None:
                by_loop.setdefault(item.loop, []).append(item)
        _settle([item for item in group if item.loop is None])
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_settle, items)

    def _write(self, group: list[_Pending]) -> None:
        started = time.perf_counter()
        try:
            with write(self.engine) as conn:
                results = store_many(
                    conn, [item.batch for item in group], arrived=[item.arrived for item in group]
                )
        except DBAPIError as exc:
            forget_runs(self.engine)  # a run created in the failed transaction does not exist
            forget_partitions(self.engine)  # nor, perhaps, a partition someone pruned
            if isinstance(exc, DataError | IntegrityError):
                self._isolate(group, exc)  # this data, not the database
                return
            for item in group:  # unreachable, restarting, deadlocked: retry later
                item.error = exc
            return
        except Exception as exc:  # validated data the storage layer still refused
            forget_runs(self.engine)
            self._isolate(group, exc)
            return
        self.flushes += 1
        for item, result in zip(group, results, strict=True):
            item.result = result
        if self.on_flush is not None:
            self.on_flush(len(group), sum(i.rows for i in group), time.perf_counter() - started)

    def _isolate(self, group: list[_Pending], exc: Exception) -> None:
        """One bad batch must not fail the others: write each alone; the bad one fails
        with a ValueError naming the reason (→ 422)."""
        if len(group) > 1:
            for item in group:
                self._write([item])
            return
        log.warning("ingest batch refused: %s", _first_line(exc))
        group[0].error = exc if isinstance(exc, ValueError) else ValueError(_first_line(exc))


def _first_line(exc: BaseException) -> str:
    reason = getattr(exc, "orig", None) or exc
    return "the database refused this batch: " + str(reason).strip().splitlines()[0]
