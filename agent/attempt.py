"""This process's attempt, from start to end, as an :class:`~.core.Agent` tells it: the
identity thread gathers who the run is and queues ``attempt_start`` (ahead of every record
held back so far); the trainer, the signal handlers and the exception hook say how it ends
(:meth:`~AttemptLifecycle.end_reason`); :meth:`~AttemptLifecycle.shutdown` sends the
goodbye and ``attempt_end``, then stops the agent's threads. A mixin of ``Agent``: these
methods share its state.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import identity, last_words
from .sink import EventRecord

if TYPE_CHECKING:
    from .checkpoints import Checkpoints
    from .config import AgentConfig
    from .exporter import Exporter
    from .gpu import GpuMonitor
    from .last_words import LastWords
    from .sink import RecordQueue
    from .stats import Stats
    from .step import Recorder

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 5.0
_IDENTITY_WAIT_AT_EXIT_S = 2.0
_CHECKPOINT_SIZE_WAIT_AT_EXIT_S = 1.0


class AttemptLifecycle:
    """The ``Agent``'s methods that start and end its attempt (mixed into it)."""

    # What they use of the Agent (set in its __init__).
    config: AgentConfig
    started_at: float
    stats: Stats
    recorder: Recorder
    checkpoints: Checkpoints
    crash_files: LastWords | None
    gpu_device: Any
    gpu_monitor: GpuMonitor | None
    signalled_at: float | None
    _records: RecordQueue
    _exporter: Exporter | None
    _relay: Any
    _identity_thread: threading.Thread | None
    _identity: dict[str, Any]
    _attempt_lock: threading.Lock
    _attempt_started: bool
    _end: tuple[str, str, int | None]
    _closed: bool
    _closing_thread: threading.Thread | None
    _flushed: threading.Event  # set once shutdown() has sent what it could
    _sigterm_pending: bool
    _settle: threading.Event
    _connected: threading.Event
    _find_place: Callable[[], None]
    _check_place: Callable[[], None]
    _event_body: Callable[..., dict[str, Any]]
    flush_soon: Callable[[], None]
    event: Callable[..., None]
    event_at: Callable[..., None]

    # -- run identity: the attempt_start event -------------------------------------------

    def _collect_identity(self) -> None:
        if self.config.placement == "pending":
            self._find_place()
        self._identity = identity.skeleton(self.config)
        try:
            identity.collect(self.config, self._identity, gpu_device=self.gpu_device)
        except Exception:  # never the trainer's problem: the fields stay None
            log.debug("trainwarden: identity collection failed", exc_info=True)
        self._start_attempt()
        self._check_place()

    def _start_attempt(self) -> None:
        """Queue ``attempt_start`` (once), ahead of every record held back so far."""
        with self._attempt_lock:
            if self._attempt_started:
                return
            self._attempt_started = True
            # The identity thread may still be filling it, or not have begun (no rank yet).
            data = copy.deepcopy(self._identity or identity.skeleton(self.config))
        self.stats.recorded += 1
        record = EventRecord(self._event_body("attempt_start", None, "info", data, self.started_at))
        self._records.open_gate(record)
        self.flush_soon()

    def end_reason(self, reason: str, detail: str = "", exit_code: int | None = None) -> None:
        """How this process is ending (``attempt_end``'s reason), said before it shuts down."""
        self._end = (reason, detail[:300], exit_code)

    def note_exit_in_flight(self) -> None:
        """``tw.shutdown()`` in a ``finally`` while an exception propagates: that exception
        ends the attempt; ``sys.exit(n)`` ends it ``completed`` with its code."""
        exc = sys.exc_info()[1]
        if exc is None or self._end[0] != "completed":
            return
        if isinstance(exc, SystemExit):
            code = exc.code
            self._end = (
                "completed",
                "",
                0 if code is None else code if isinstance(code, int) else 1,
            )
        else:
            code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
            self.end_reason("exception", f"{type(exc).__name__}: {exc}", code)

    def _wait_for_identity(self, timeout_s: float) -> None:
        thread = self._identity_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout_s))

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing_thread = threading.current_thread()
        try:
            self._shutdown(timeout_s)
        finally:
            self._flushed.set()
        if self._sigterm_pending and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)  # die of it, now that the flush is done

    def _shutdown(self, timeout_s: float) -> None:
        started = time.monotonic()
        # The attempt ended when the trainer said so: not after the waits below (the
        # identity, the checkpoint sizes), which would add to its GPU-hours.
        ended_at = time.time()
        self._settle.set()  # a process still without its rank settles it now
        # ... on the identity thread, which then makes the exporter: wait for it (a busy
        # machine can keep that thread from running for a while), or the records it would
        # send are neither sent nor spooled.
        self._connected.wait(timeout_s / 2)
        if self._identity_thread is not None:
            # attempt_start goes out before the goodbye: with what is known by now.
            self._wait_for_identity(min(timeout_s / 2, _IDENTITY_WAIT_AT_EXIT_S))
            self._start_attempt()
        self._records.open_gate(None)
        self.checkpoints.finish(min(timeout_s / 4, _CHECKPOINT_SIZE_WAIT_AT_EXIT_S))
        # An exception that left a step and was never followed by a good step is how
        # this process ends: report it, so the collector marks the rank failed.
        last_step, last_error = self.recorder.last_step, self.recorder.last_error
        said: dict[str, Any] = {}
        if self.signalled_at is not None:
            said["signalled_at"] = self.signalled_at
        if last_error is not None:
            self.event("shutdown", step=last_step, severity="critical", error=last_error, **said)
        else:
            self.event("shutdown", step=last_step, **said)
        if self._identity_thread is not None:
            reason, detail, exit_code = self._end
            if reason == "completed" and last_error is not None:
                reason, detail = "exception", last_error  # it left a step, and ends us
            self.event_at(
                ended_at,
                "attempt_end",
                step=None,
                severity="info",
                data={
                    "reason": reason,
                    "detail": detail,
                    "exit_code": exit_code,
                    "last_step": last_step,
                },
            )
        if self.gpu_monitor is not None:
            self.gpu_monitor.stop()
        if self.crash_files is not None:  # a sibling died of a signal: said for it, now
            self.crash_files.report(wait_s=last_words.DYING_WAIT_S)
            self.crash_files.close()
        if self._exporter is not None:
            self._exporter.shutdown(max(0.1, timeout_s - (time.monotonic() - started)))
        if self._relay is not None:  # what it holds goes on; the node's others go direct
            self._relay.stop()
