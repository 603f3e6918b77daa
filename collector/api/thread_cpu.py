"""The collector's CPU by thread (``trainwarden_collector_thread_cpu_seconds_total``): which
of its parts is busy, read from ``/proc/self/task`` at each scrape (Linux; elsewhere the
family is left out).

``thread`` names a part: ``main`` (in ``trainwarden serve`` the event loop: HTTP, each
request's parse, validation and answer), ``writer`` (the group commit), ``alerts``,
``health``, ``rollup``, ``actions``, ``incidents``, ``pressure`` (the collector's other
threads, by their names less ``trainwarden-``), ``pool`` (the threads the web framework
runs blocking handlers on: reads of the API and the UI) and ``other``. The main thread
near a whole core (``rate(...[1m])`` near 1) means the collector's HTTP is its limit:
relays (a request a node) or ``serve --workers``; the writer near 1, the database.

A thread that ended keeps its part's count, as read at the last scrape before it
ended, so each series only grows. With ``serve --workers N`` the family is left out: a
scrape is answered by one worker, and its threads are not the collector's.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

TASKS = "/proc/self/task"
POOLS = ("AnyIO worker thread", "asyncio_", "ThreadPoolExecutor")


def part(name: str) -> str:
    """The part of the collector a thread of this name does (the ``thread`` label)."""
    if name == "MainThread":
        return "main"
    if name.startswith("trainwarden-"):
        return name.removeprefix("trainwarden-")
    return "pool" if name.startswith(POOLS) else "other"


def cpu_seconds(tid: int) -> float | None:
    """A thread's user and system CPU so far (None: it ended, or no /proc)."""
    try:
        with open(f"{TASKS}/{tid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # After the name in parentheses (which may hold spaces): state, then utime and stime
    # as the 12th and 13th fields (proc(5): fields 14 and 15), in clock ticks.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ThreadCpuCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[str, float]] = {}  # thread id: (part, CPU) at the last scrape
        self._ended: dict[str, float] = defaultdict(float)  # parts' CPU of threads since ended

    def totals(self) -> dict[str, float]:
        """Each part's CPU seconds so far, threads that ended included."""
        now: dict[int, tuple[str, float]] = {}
        for thread in threading.enumerate():
            tid = thread.native_id
            if tid is not None and (seconds := cpu_seconds(tid)) is not None:
                now[tid] = (part(thread.name), seconds)
        with self._lock:
            for tid, (was, seconds) in self._seen.items():
                still = now.get(tid)
                if still is None or still[0] != was or still[1] < seconds:  # ended (or reused)
                    self._ended[was] += seconds
            self._seen = now
            totals = defaultdict(float, self._ended)
        for name, seconds in now.values():
            totals[name] += seconds
        return dict(totals)

    def collect(self) -> Iterator[CounterMetricFamily]:
        if not os.path.isdir(TASKS):
            return
        family = CounterMetricFamily(
            "trainwarden_collector_thread_cpu_seconds",
            "CPU seconds the collector's threads have used, by the part they do (main: the "
            "event loop; writer: the group commit; pool: the API's and UI's blocking reads).",
            labels=["thread"],
        )
        for name, seconds in sorted(self.totals().items()):
            family.add_metric([name], seconds)
        yield family
