"""The collector's CPU by thread (collector/api/thread_cpu.py), read from /proc."""

from __future__ import annotations

import threading
import time

from trainwarden.collector.api.thread_cpu import ThreadCpuCollector, cpu_seconds, part


def _burn(seconds: float, started: threading.Event, go_on: threading.Event) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:  # CPU, not sleep
        pass
    started.set()
    go_on.wait(10)


def test_threads_are_counted_by_part_and_an_ended_ones_cpu_stays() -> None:
    threads = ThreadCpuCollector()
    base = threads.totals()
    started, go_on = threading.Event(), threading.Event()
    worker = threading.Thread(
        target=_burn, args=(0.3, started, go_on), name="trainwarden-burner", daemon=True
    )
    worker.start()
    assert started.wait(10)
    assert worker.native_id is not None
    own = cpu_seconds(worker.native_id)
    assert own is not None and own >= 0.25  # its own CPU, in clock ticks
    during = threads.totals()
    assert during["burner"] - base.get("burner", 0.0) >= 0.25
    assert during["main"] > 0  # this test's own thread
    go_on.set()
    worker.join(10)
    # join() returns when the thread has finished its Python; the kernel's task can
    # outlive that a moment (seen: its /proc entry still there right after join)
    deadline = time.monotonic() + 10
    while cpu_seconds(worker.native_id) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cpu_seconds(worker.native_id) is None
    after = threads.totals()  # the thread is gone: its part keeps what it had used
    assert after["burner"] >= during["burner"]


def test_thread_names_map_to_the_parts_an_operator_reads() -> None:
    assert part("MainThread") == "main"
    assert part("trainwarden-writer") == "writer"
    assert part("trainwarden-alerts") == "alerts"
    assert part("AnyIO worker thread") == "pool"
    assert part("asyncio_3") == "pool"
    assert part("Thread-7 (poll)") == "other"
