"""The sampled path of the communication split: one ``torch.profiler`` window every N steps.

It sees what the comm hook cannot: idle time, and communication of wrappers without a
DDP hook (FSDP, tensor / pipeline parallel collectives). The training thread only
starts and stops the profiler around the step; the trace is analysed on the exporter
thread with an interval sweep, and only the resulting split is kept (the raw trace is
written out only when ``profile_dir`` asks for it).

- CPU (gloo): compute = ``aten::`` ops on the training thread; communication =
  ``gloo:*`` / ``nccl:*`` collectives on the backend's threads.
- GPU: compute = kernels that are not NCCL's; communication = NCCL kernels; the window
  is the span of the step's kernels.

Stopping the profiler on a GPU flushes its buffers (a device sync on that one step).
torch's profiler (Kineto) prints two ``USDT: ... profiler_start`` / ``profiler_stop``
lines to stderr per window, below its error level: when the agent profiles and
``KINETO_LOG_LEVEL`` is unset, it is set to :data:`KINETO_QUIET` before the first window
(Kineto reads it once, when it first starts), which silences them and Kineto's other
messages in this process. A trainer that sets ``KINETO_LOG_LEVEL`` keeps its own.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from .timing import split_from_trace

log = logging.getLogger(__name__)

STEP_RANGE = "trainwarden.step"
DEFAULT_EVERY = 1000
FIRST_AT = 20  # the first window comes early, after warm-up, so a new run shows a split soon
KINETO_QUIET = "6"
"""Kineto's log level above its highest (5: the ``USDT`` lines of each window)."""


class SampledProfiler:
    def __init__(self, *, every: int, profile_dir: str | None = None) -> None:
        self.every = every
        self.profile_dir = profile_dir
        self.windows = 0
        if every > 0:  # before Kineto's first start, which reads it
            os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)

    def due(self, count: int) -> bool:
        """Whether the ``count``-th step this process runs (from 1) is profiled."""
        return self.every > 0 and (count == FIRST_AT or count % self.every == 0)

    def next_due(self, count: int) -> int:
        """The first step count after ``count`` that is profiled; ``sys.maxsize`` when off."""
        if self.every <= 0:
            return sys.maxsize
        following = (count // self.every + 1) * self.every
        return FIRST_AT if count < FIRST_AT < following else following

    def start(self) -> Any:
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.start()
        scope = record_function(STEP_RANGE)
        scope.__enter__()
        return prof, scope

    def stop(self, handle: Any, step: int) -> Any:
        prof, scope = handle
        scope.__exit__(None, None, None)
        prof.stop()
        self.windows += 1
        if self.profile_dir:
            os.makedirs(self.profile_dir, exist_ok=True)
            prof.export_chrome_trace(
                os.path.join(self.profile_dir, f"step{step}-pid{os.getpid()}.json")
            )
        return prof.profiler.kineto_results


def split_from_profile(results: Any) -> dict[str, int] | None:
    """The compute / exposed / overlapped / idle split of one profiled step (ns)."""
    from torch.autograd import DeviceType

    events = results.events()
    step = next((e for e in events if e.name() == STEP_RANGE), None)
    if step is None:
        return None
    kernels = [e for e in events if e.device_type() == DeviceType.CUDA]
    if kernels:
        comm = [(e.start_ns(), e.end_ns()) for e in kernels if "nccl" in e.name().lower()]
        compute = [(e.start_ns(), e.end_ns()) for e in kernels if "nccl" not in e.name().lower()]
        start = min(e.start_ns() for e in kernels)
        end = max(e.end_ns() for e in kernels)
        return split_from_trace(compute, comm, start, end)
    main = step.start_thread_id()
    comm = [
        (e.start_ns(), e.end_ns())
        for e in events
        if e.name().startswith(("gloo:", "nccl:")) and e.device_type() == DeviceType.CPU
    ]
    compute = [
        (e.start_ns(), e.end_ns())
        for e in events
        if e.name().startswith("aten::") and e.start_thread_id() == main
    ]
    return split_from_trace(compute, comm, step.start_ns(), step.end_ns())
