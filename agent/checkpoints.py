"""Checkpoint cost: ``tw.checkpoint_saved(..., seconds=, bytes=)``, ``tw.checkpointing``
and ``tw.checkpoint_drained``.

The agent never writes checkpoints; it times the trainer's save and measures what it
wrote. The size is read on a short-lived background thread (a sharded checkpoint is a
directory tree of thousands of files), so the training thread only takes two clock
readings. The ``checkpoint`` event goes out once the size is known, or at shutdown
(:meth:`Checkpoints.finish`) with the size if it comes within the deadline.
:class:`Checkpoints` needs of the agent only where events go (:class:`EventSink`).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from typing import Any, Protocol

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Where checkpoint events go (the agent's ``event`` and ``event_at``)."""

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None: ...

    def event_at(
        self, ts: float, kind: str, *, step: int | None, severity: str, data: dict[str, Any]
    ) -> None: ...


def checked_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return int(step)


def checked_seconds(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return number


def checked_bytes(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"bytes must be an int (the checkpoint's size), got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(f"bytes must be >= 0, got {value}")
    return int(value)


def checkpoint_data(
    path: Any,
    *,
    seconds: Any = None,
    bytes: Any = None,  # noqa: A002 - the public keyword
    drain_seconds: Any = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``checkpoint`` event's data: ``path``, the trainer's own fields, and the typed
    ones that were given (checked: a wrong value is a bug at the call site)."""
    typed = {
        "seconds": checked_seconds(seconds, "seconds"),
        "bytes": checked_bytes(bytes),
        "drain_seconds": checked_seconds(drain_seconds, "drain_seconds"),
    }
    data = {"path": None if path is None else os.fspath(path), **(meta or {})}
    data.update({k: v for k, v in typed.items() if v is not None})
    return data


def size_of(path: str) -> int | None:
    """Bytes of a file, or of every file under a directory; None if there is nothing."""
    try:
        if not os.path.isdir(path):
            return os.path.getsize(path)
    except OSError:
        return None
    total = 0
    stack = [path]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:  # removed meanwhile: a rotating checkpoint folder
                        continue
        except OSError:
            continue
    return total


class Checkpointing:
    """``with tw.checkpointing(step, path) as ck: save(...)``; ``ck.drained()`` when an
    async save has finished writing."""

    def __init__(self, owner: Checkpoints, step: int, path: Any = None) -> None:
        self._owner = owner
        self._events = owner.events
        self.step = step
        self.path: str | None = None if path is None else os.fspath(path)
        self.seconds: float | None = None
        """Blocking save time: how long the ``with`` block took."""
        self.bytes: int | None = None
        self.drain_seconds: float | None = None
        self._t0 = 0.0
        self._ended = 0.0  # perf_counter at the block's end
        self._ended_wall = 0.0
        self._lock = threading.Lock()
        self._recorded = False
        self._sizer: threading.Thread | None = None

    def __enter__(self) -> Checkpointing:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._ended = time.perf_counter()
        self._ended_wall = time.time()
        self.seconds = self._ended - self._t0
        if exc_type is not None:
            self._events.event(
                "checkpoint_failed",
                step=self.step,
                severity="warning",
                path=self.path,
                seconds=self.seconds,
                error=f"{exc_type.__name__}: {exc}"[:300],
            )
            return  # the exception goes on
        if self.path is None:
            self.finish()
            return
        self._owner.measuring.add(self)
        self._sizer = threading.Thread(
            target=self._measure, name="trainwarden-checkpoint-size", daemon=True
        )
        self._sizer.start()

    def _measure(self) -> None:
        try:
            self.bytes = size_of(self.path) if self.path is not None else None
        except Exception:
            log.debug("trainwarden: cannot measure %s", self.path, exc_info=True)
        self.finish()

    def finish(self, wait_s: float = 0.0) -> None:
        """Record the ``checkpoint`` event (once), with the size if known by now."""
        sizer = self._sizer
        if sizer is not None and wait_s > 0 and sizer is not threading.current_thread():
            sizer.join(wait_s)
        with self._lock:
            if self._recorded:
                return
            self._recorded = True
        self._owner.measuring.discard(self)
        data = checkpoint_data(self.path, seconds=self.seconds, bytes=self.bytes)
        self._events.event_at(
            self._ended_wall, "checkpoint", step=self.step, severity="info", data=data
        )

    def drained(self) -> float:
        """Call when the async save has finished writing: records ``checkpoint_drained``
        with the seconds since the ``with`` block ended, and returns them."""
        if not self._ended:
            raise RuntimeError("ck.drained() is for after the `with tw.checkpointing(...)` block")
        if self.drain_seconds is None:
            self.drain_seconds = time.perf_counter() - self._ended
            self._events.event(
                "checkpoint_drained",
                step=self.step,
                path=self.path,
                drain_seconds=self.drain_seconds,
            )
        return self.drain_seconds


class Checkpoints:
    """The checkpoints one agent reports, and those whose size is still being measured."""

    def __init__(self, events: EventSink) -> None:
        self.events = events
        self.measuring: set[Checkpointing] = set()

    def saved(
        self,
        step: int,
        path: Any,
        *,
        seconds: float | None = None,
        bytes: int | None = None,  # noqa: A002 - the public keyword
        drain_seconds: float | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """``tw.checkpoint_saved``: the ``checkpoint`` event, now."""
        step = checked_step(step)
        data = checkpoint_data(
            path, seconds=seconds, bytes=bytes, drain_seconds=drain_seconds, meta=meta
        )
        self.events.event_at(time.time(), "checkpoint", step=step, severity="info", data=data)

    def timing(self, step: int, path: Any = None) -> Checkpointing:
        """``tw.checkpointing``: a context manager that times the save."""
        return Checkpointing(self, checked_step(step), path)

    def drained(self, step: int, seconds: float, path: Any = None) -> None:
        """``tw.checkpoint_drained``: an async save finished writing ``seconds`` after."""
        step = checked_step(step)
        drain = checked_seconds(seconds, "seconds")
        if drain is None:
            raise TypeError("seconds must be a number of seconds, got None")
        self.events.event(
            "checkpoint_drained",
            step=step,
            path=None if path is None else os.fspath(path),
            drain_seconds=drain,
        )

    def finish(self, timeout_s: float) -> None:
        """Checkpoints whose size is still being measured go out now, with it if it comes
        within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for ck in list(self.measuring):
            ck.finish(wait_s=max(0.0, deadline - time.monotonic()))
