"""Background work inside ``serve``: a daemon thread that calls a function every interval."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Loop:
    """Calls ``work()`` every ``interval_s`` until stopped. A failure (a database outage,
    say) is logged and the next tick tries again: the loop never ends by itself.

    ``max_cpu_share``: at most this share of one core for ``work`` (its thread's CPU
    time): a pass that cost more spaces the next one out, so that work growing with the
    number of ranks cannot starve ingest, which shares the process and its cores.
    ``spacing_s`` is the interval in effect."""

    def __init__(
        self,
        name: str,
        interval_s: float,
        work: Callable[[], object],
        *,
        max_cpu_share: float | None = None,
    ) -> None:
        self.name = name
        self.interval_s = interval_s
        self.max_cpu_share = max_cpu_share
        self.spacing_s = interval_s
        self._work = work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        # Fixed rate: a slow pass does not push every later one back (unless it is over
        # its CPU share).
        due = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            started, cpu = time.monotonic(), time.thread_time()
            due = max(due + self.interval_s, started)
            try:
                self._work()
            except Exception:
                log.exception("%s failed; retrying", self.name)
            self.spacing_s = spaced(self.interval_s, time.thread_time() - cpu, self.max_cpu_share)
            due = max(due, started + self.spacing_s)


def spaced(interval_s: float, cpu_s: float, max_cpu_share: float | None) -> float:
    """The interval after a pass that cost ``cpu_s`` of CPU: ``interval_s``, or longer
    when the pass cost more than ``max_cpu_share`` of it."""
    if not max_cpu_share:
        return interval_s
    return max(interval_s, cpu_s / max_cpu_share)
