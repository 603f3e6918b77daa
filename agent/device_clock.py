"""A step on the GPU's own clock: CUDA events recorded on the training thread's stream.

On a GPU the host only *queues* work; a trainer that never waits on the device (the
agent's own rule) runs ahead of it by many steps, and the host's time for a step is
then the time to queue it: on an H200 a 39 ms step measured 1.7 ms on the host, and
MFU came out 18x the truth (bench/results/gpu-h200-host-clock.txt). So once the trainer uses CUDA
the agent records an event where the step starts, at each phase mark, around each
gradient bucket's collective and where the step ends. Recording is asynchronous and
never waits on the device; the exporter thread reads the events once the step's last
one has completed (``query()``), and derives from them the step time, the phases, the
communication split and the GPU's idle gap before the step (the data wait).

The agent never initializes CUDA itself: the clock starts with the first step after
the trainer has (``torch.cuda.is_initialized()``).
"""

from __future__ import annotations

from typing import Any

Interval = tuple[int, int]


class DeviceClock:
    """The CUDA events of one step (created on the training thread)."""

    __slots__ = ("_cuda", "arrived", "start", "end", "settled", "marks", "comm")

    def __init__(self, torch: Any, arrived: Any = None) -> None:
        self._cuda = torch.cuda
        # Before a sampled step's profiler start or FLOP counter: the GPU's wait for this
        # step ends here, as the host's data wait does (that work is the agent's).
        self.arrived = arrived
        self.start = self.now()
        self.end: Any = None
        # After a sampled step's profiler stop or FLOP count: the next step's GPU wait
        # counts from here, as its host data wait does (that work is the agent's).
        self.settled: Any = None
        self.marks: list[Any] = []  # one per phase mark (None: under capture), as record.phases
        self.comm: list[tuple[Any, Any]] = []  # (bucket ready, collective done)

    def now(self) -> Any:
        """An event recorded now on the current stream: when the GPU gets to this point."""
        return event_now(self._cuda)


def event_now(cuda: Any) -> Any:
    """A ``torch.cuda.Event`` with timing, recorded now on the current stream; ``None``
    while that stream is being captured into a CUDA graph (no event may go there)."""
    if cuda.is_current_stream_capturing():
        return None
    event = cuda.Event(enable_timing=True)
    event.record()
    return event


class Timing:
    """A step's times on the GPU's clock, in ns from the step's start."""

    __slots__ = ("duration_ns", "marks_ns", "comm", "gap_ns")

    def __init__(
        self, duration_ns: int, marks_ns: list[int | None], comm: list[Interval], gap_ns: int | None
    ) -> None:
        self.duration_ns = duration_ns
        self.marks_ns = marks_ns
        self.comm = comm
        self.gap_ns = gap_ns


def ready(clock: DeviceClock) -> bool:
    """Whether every event of the step has completed (never waits)."""
    if clock.end is None or not clock.end.query():
        return False
    return all(done.query() for _, done in clock.comm)


def read(clock: DeviceClock, previous_end: Any) -> Timing:
    """The step's times; call once :func:`ready`. ``previous_end``: the end event of the
    step before on this process (the gap between them is the GPU's wait for this step)."""
    start = clock.start

    def ns(event: Any) -> int:
        return round(start.elapsed_time(event) * 1e6)

    gap = None
    if previous_end is not None:
        arrived = start if clock.arrived is None else clock.arrived
        gap = max(0, round(previous_end.elapsed_time(arrived) * 1e6))
    return Timing(
        ns(clock.end),
        [None if mark is None else ns(mark) for mark in clock.marks],
        [(ns(begin), ns(done)) for begin, done in clock.comm],
        gap,
    )
