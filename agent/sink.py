"""Where the agent's records go: the exporter's bounded queue.

:meth:`RecordQueue.put` is what a step's exit, ``tw.event`` and the GPU sampler call,
from any thread: count the record, append it to a ``deque`` (past ``queue_size`` the
oldest is dropped and counted, as OpenTelemetry's BatchProcessor does) and wake the
exporter once a batch is ready. ``deque.append`` and ``popleft`` are atomic: no lock.

Until the process's ``attempt_start`` event is queued (a background thread gathers its
identity), records are held back, under a lock, for at most a deadline: the collector
learns which attempt a process is before its first step. Once the gate is open, ``put``
reads one attribute for it. Without an exporter (no collector URL, or a forked child),
the last ``queue_size`` records stay in memory for ``tw.recent``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .stats import Stats


class EventRecord:
    __slots__ = ("kind", "body", "queued_at")

    def __init__(self, body: dict[str, Any]) -> None:
        self.kind = "event"
        self.body = body
        self.queued_at = time.monotonic()


class GpuRecord:
    __slots__ = ("kind", "body", "queued_at")

    def __init__(self, body: dict[str, Any]) -> None:
        self.kind = "gpu"
        self.body = body
        self.queued_at = time.monotonic()


class RecordQueue:
    """The agent's records, on their way to the exporter thread (``queue``)."""

    def __init__(self, *, size: int, batch_size: int, stats: Stats) -> None:
        self.queue: deque[Any] = deque()  # the exporter drains it
        self._local: deque[Any] = deque(maxlen=size)  # without an exporter
        self._size = size
        self._batch_size = batch_size
        self._stats = stats
        self.wake: Callable[[], None] | None = None  # the exporter's; None: keep in memory
        self._gate_lock = threading.Lock()
        self._held: deque[Any] = deque()
        self.gated = False
        self._gate_deadline = 0.0

    def connect(self, wake: Callable[[], None], *, hold_s: float) -> None:
        """Records go to the exporter, which ``wake`` wakes; the first are held back until
        :meth:`open_gate`, for at most ``hold_s``."""
        self.wake = wake
        self.gated = True
        self.hold(hold_s)

    def hold(self, seconds: float) -> None:
        """While gated, hold records back for at most ``seconds`` from now."""
        self._gate_deadline = time.monotonic() + seconds

    def put(self, record: Any) -> None:
        self._stats.recorded += 1
        if self.gated and self._hold(record):
            return
        self._append(record)

    def _hold(self, record: Any) -> bool:
        """Hold ``record`` back while the gate is closed (True), until its deadline: then
        the records go out without waiting for the first one."""
        if time.monotonic() >= self._gate_deadline:
            self.open_gate(None)
            return False
        with self._gate_lock:
            if not self.gated:
                return False
            held = self._held
            if len(held) >= self._size:
                held.popleft()
                self._stats.dropped_queue_full += 1
            held.append(record)
            return True

    def open_gate(self, first: Any) -> None:
        """Queue ``first`` (if any), then what was held back, in order. ``gated`` turns
        False only once they are all queued: a record that comes meanwhile waits on the
        lock and goes behind them."""
        with self._gate_lock:
            if self.gated:
                if first is not None:
                    self._append(first)
                while self._held:
                    self._append(self._held.popleft())
                self.gated = False
                return
        if first is not None:
            self._append(first)  # it came late: as soon as it is ready

    def _append(self, record: Any) -> None:
        wake = self.wake
        if wake is None:
            self._local.append(record)
            return
        queue = self.queue
        if len(queue) >= self._size:
            # Drop the oldest, as OpenTelemetry's BatchProcessor does, and count it.
            try:
                queue.popleft()
                self._stats.dropped_queue_full += 1
            except IndexError:  # the exporter emptied it meanwhile
                pass
        queue.append(record)
        if len(queue) >= self._batch_size:
            wake()

    def recent(self, n: int) -> list[Any]:
        """The last ``n`` records kept in memory (only when there is no exporter)."""
        return list(self._local)[-n:]

    def forget_exporter(self) -> None:
        """After ``fork``: the child has no exporter thread; its records stay in memory."""
        self.wake = None
        self._gate_lock = threading.Lock()  # another thread may have held it at the fork
        self.gated = False
