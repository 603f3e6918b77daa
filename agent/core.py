"""The per-process agent and the ``tw.step`` context manager.

Hot path (``Step.__enter__`` / ``__exit__``): two clock reads, one small object, one
``deque.append``. No locks, no I/O, no device sync; everything else happens on the
exporter thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import uuid
from collections import deque
from typing import Any

from .config import AgentConfig
from .exporter import Exporter, HttpTransport, Transport
from .values import Captured, capture

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
_SHUTDOWN_TIMEOUT_S = 5.0


class StepRecord:
    __slots__ = (
        "kind",
        "step",
        "wall_start_ns",
        "duration_ns",
        "data_wait_ns",
        "tokens",
        "loss",
        "error",
        "queued_at",
    )

    def __init__(
        self, step: int, wall_start_ns: int, data_wait_ns: int | None, tokens: Any
    ) -> None:
        self.kind = "step"
        self.step = step
        self.wall_start_ns = wall_start_ns
        self.duration_ns = 0
        self.data_wait_ns = data_wait_ns
        self.tokens = tokens
        self.loss: float | Captured | None = None
        self.error: str | None = None
        self.queued_at = 0.0


class EventRecord:
    __slots__ = ("kind", "body", "queued_at")

    def __init__(self, body: dict[str, Any]) -> None:
        self.kind = "event"
        self.body = body
        self.queued_at = time.monotonic()


class Step:
    """One training step. Use as ``with tw.step(i, tokens=n) as s: ... s.loss(loss)``."""

    __slots__ = ("_agent", "_record", "_t0")

    def __init__(self, agent: Agent, step: int, tokens: Any) -> None:
        self._agent = agent
        if tokens is not None and not isinstance(tokens, int):
            try:
                tokens = int(tokens)  # a tensor's numel() or a numpy int; a CUDA tensor would sync
            except (TypeError, ValueError):
                tokens = None
        self._record = StepRecord(int(step), 0, None, tokens)
        self._t0 = 0

    def __enter__(self) -> Step:
        t0 = time.perf_counter_ns()
        record = self._record
        record.wall_start_ns = time.time_ns()
        last_end = self._agent._last_step_end_ns
        if last_end is not None:
            record.data_wait_ns = t0 - last_end  # the gap since the previous step ended
        self._t0 = t0
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        t1 = time.perf_counter_ns()
        record = self._record
        record.duration_ns = t1 - self._t0
        if exc_type is not None:
            record.error = exc_type.__name__
        record.queued_at = time.monotonic()
        agent = self._agent
        agent._last_step_end_ns = t1
        agent._last_step = record.step
        agent._enqueue(record)

    def loss(self, value: Any) -> None:
        """Record this rank's loss: a tensor (read later, off this thread) or a number."""
        self._record.loss = capture(value)

    @property
    def step(self) -> int:
        return self._record.step


class Agent:
    """One per process. Created by ``tw.init``; the module functions delegate to it."""

    def __init__(self, config: AgentConfig, *, transport: Transport | None = None) -> None:
        self.config = config
        self.session_id = uuid.uuid4().hex
        self.started_at = time.time()
        self._last_step_end_ns: int | None = None
        self._last_step: int | None = None
        self._queue: deque[Any] = deque()
        self._local: deque[Any] = deque(maxlen=config.queue_size)
        self.stats = {
            "recorded": 0,
            "dropped_queue_full": 0,
            "sent": 0,
            "batches_sent": 0,
            "batches_failed": 0,
            "dropped_send_failed": 0,
        }
        self._exporter: Exporter | None = None
        if transport is None and config.url is not None:
            transport = HttpTransport(
                config.url, token=config.token, timeout_s=config.request_timeout_s
            )
        if transport is not None:
            self._exporter = Exporter(
                queue=self._queue,
                header=self._header,
                transport=transport,
                run=config.run,
                batch_size=config.batch_size,
                interval_s=config.flush_interval_s,
                stats=self.stats,
            )
        else:
            log.warning(
                "trainwarden: no collector URL (tw.init(url=...) or TRAINWARDEN_URL); "
                "keeping the last %d records in memory only",
                config.queue_size,
            )
        self.event("start", pid=os.getpid(), world_size=config.world_size)
        self._closed = False

    def _header(self) -> dict[str, Any]:
        c = self.config
        return {
            "rank": c.rank,
            "world_size": c.world_size,
            "local_rank": c.local_rank,
            "host": c.host,
            "node": c.node,
            "pid": os.getpid(),
            "session": self.session_id,
            "started_at": self.started_at,
            "version": AGENT_VERSION,
            "sent_at": time.time(),
        }

    def _enqueue(self, record: Any) -> None:
        self.stats["recorded"] += 1
        if self._exporter is None:
            self._local.append(record)
            return
        queue = self._queue
        if len(queue) >= self.config.queue_size:
            # Drop the oldest, as OpenTelemetry's BatchProcessor does, and count it.
            try:
                queue.popleft()
                self.stats["dropped_queue_full"] += 1
            except IndexError:  # the exporter emptied it meanwhile
                pass
        queue.append(record)
        if len(queue) >= self.config.batch_size:
            self._exporter.wake()

    def step(self, step: int, tokens: Any = None) -> Step:
        return Step(self, step, tokens)

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None:
        """Queue an event (restart, shutdown, ...). Cheap; safe from any thread."""
        body = {
            "id": uuid.uuid4().hex,
            "kind": kind,
            "ts": time.time(),
            "step": step,
            "severity": severity,
            "data": data,
        }
        self._enqueue(EventRecord(body))

    def recent(self, n: int = 100) -> list[Any]:
        """The last ``n`` records kept locally (only when there is no collector)."""
        return list(self._local)[-n:]

    def shutdown(self, timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> None:
        if self._closed:
            return
        self._closed = True
        self.event("shutdown", step=self._last_step)
        if self._exporter is not None:
            self._exporter.shutdown(timeout_s)


_agent: Agent | None = None
_atexit_registered = False


def current() -> Agent:
    if _agent is None:
        raise RuntimeError("trainwarden: call tw.init(run=...) before tw.step(...)")
    return _agent


def set_current(agent: Agent | None) -> None:
    global _agent, _atexit_registered
    if agent is not None and not _atexit_registered:
        atexit.register(_flush_at_exit)
        _atexit_registered = True
    _agent = agent


def _flush_at_exit() -> None:
    if _agent is not None:
        try:
            _agent.shutdown(timeout_s=_SHUTDOWN_TIMEOUT_S)
        except Exception:  # at exit, never turn a clean exit into a traceback
            log.exception("trainwarden: flush at exit failed")
