"""Background work inside ``serve``: a daemon thread that calls a function every interval."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Loop:
    """Calls ``work()`` every ``interval_s`` until stopped. A failure (a database outage,
    say) is logged and the next tick tries again: the loop never ends by itself."""

    def __init__(self, name: str, interval_s: float, work: Callable[[], object]) -> None:
        self.name = name
        self.interval_s = interval_s
        self._work = work
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        # Fixed rate: a slow pass does not push every later one back.
        due = time.monotonic() + self.interval_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            due = max(due + self.interval_s, time.monotonic())
            try:
                self._work()
            except Exception:
                log.exception("%s failed; retrying", self.name)
