"""Checkpoint cost: ``tw.checkpoint_saved(..., seconds=, bytes=)`` and ``tw.checkpointing``.

The agent never writes checkpoints; it times the trainer's save and measures what it
wrote. The size is read on a short-lived background thread (a sharded checkpoint is a
directory tree of thousands of files), so the training thread only takes two clock
readings. The ``checkpoint`` event goes out once the size is known.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import Agent

log = logging.getLogger(__name__)


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

    def __init__(self, agent: Agent, step: int, path: Any = None) -> None:
        self._agent = agent
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
            self._agent.event(
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
        self._agent._checkpoints.add(self)
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
        self._agent._checkpoints.discard(self)
        data = checkpoint_data(self.path, seconds=self.seconds, bytes=self.bytes)
        self._agent.event_at(
            self._ended_wall, "checkpoint", step=self.step, severity="info", data=data
        )

    def drained(self) -> float:
        """Call when the async save has finished writing: records ``checkpoint_drained``
        with the seconds since the ``with`` block ended, and returns them."""
        if not self._ended:
            raise RuntimeError("ck.drained() is for after the `with tw.checkpointing(...)` block")
        if self.drain_seconds is None:
            self.drain_seconds = time.perf_counter() - self._ended
            self._agent.event(
                "checkpoint_drained",
                step=self.step,
                path=self.path,
                drain_seconds=self.drain_seconds,
            )
        return self.drain_seconds
