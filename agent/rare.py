"""A step's rare work, off the common path of :mod:`.step`.

:class:`RareWork` attaches itself to the agent's :class:`.step.Recorder` and keeps its
flag, ``rare_from``. Every step takes this path while:

- torch sees a GPU (``torch.cuda.is_available()``): until the trainer has initialized
  CUDA, each step asks (:meth:`RareWork.check_cuda`; the agent never initializes CUDA
  itself); from then on each step runs on the GPU's clock (CUDA events,
  :mod:`.device_clock`) and reports CUDA memory (host-side counters: no sync);
- the peak FLOP/s waits for that answer (:meth:`RareWork.find_peak`);
- a fault drill is on (:mod:`.drills`): its faults fire at step boundaries.

Otherwise only two kinds of step do: the one that counts FLOPs with
``FlopCounterMode`` (once, asked by ``tw.watch``), and the profiler's window steps
(:mod:`.profiler`: the 20th step run, then one in ``profile_every``). Their sampling
work is the agent's time, not the trainer's: the next step's data wait starts after it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .device_clock import DeviceClock, event_now
from .mfu import Peak, resolve_peak
from .profiler import SampledProfiler

if TYPE_CHECKING:
    from .config import AgentConfig
    from .drills import Drill, DrillHost
    from .encode import StepEncoder
    from .step import Recorder, StepRecord

# What a step on this path started, for its exit: (FLOP counter, profiler window).
Sample = tuple[Any, Any]
_NOTHING_SAMPLED: Sample = (None, None)


class RareWork:
    """The rare path of a step's entry and exit, and the state it keeps."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        config: AgentConfig,
        encoder: StepEncoder,
        drill_host: DrillHost,
    ) -> None:
        self._recorder = recorder
        recorder.rare = self
        self._config = config
        self._encoder = encoder  # its peak and FLOP model feed MFU on the exporter thread
        self.profiler = SampledProfiler(every=config.profile_every, profile_dir=config.profile_dir)
        self.drill: Drill | None = None
        self._drill_host = drill_host  # what a drill's faults act on: the agent
        self.count_flops_next = False
        # Called once, at the first step's entry (the agent settles the process's rank).
        self.on_first_step: Callable[[], None] | None = None
        # CUDA: while a GPU is there but the trainer has not used it yet, each step asks
        # (check_cuda); from the first step after it has, steps run on the GPU's clock and
        # report CUDA memory, and the peak is the GPU's.
        self.torch: Any = sys.modules.get("torch")  # only if the trainer imported it
        self.cuda = False
        self.cuda_possible = False
        if self.torch is not None:
            try:
                self.cuda_possible = bool(self.torch.cuda.is_available())
            except Exception:  # a broken driver: no CUDA for the agent
                self.cuda_possible = False
        self.cuda_memory: Any = None
        self.peak_pending = False
        if config.peak_flops:
            encoder.peak = Peak(config.peak_flops, "given")
        elif encoder.flop_model.source is not None:
            self.find_peak()
        self.schedule()

    def schedule(self) -> None:
        """Set the recorder's flag: every step (0) while CUDA may be in use, the peak
        waits, FLOPs are to be counted or a drill is on; else the next profiler window."""
        every_step = (
            self.cuda
            or self.cuda_possible
            or self.peak_pending
            or self.count_flops_next
            or self.drill is not None
            or self.on_first_step is not None
        )
        recorder = self._recorder
        recorder.rare_from = 0 if every_step else self.profiler.next_due(recorder.steps_run)

    # -- the step's entry and exit (what step.Step calls on this path) -------------------

    def use_config(self, config: AgentConfig) -> None:
        """The agent's config once the process's rank is known (its local rank picks the
        GPU whose peak MFU divides by)."""
        self._config = config

    def enter(self, record: StepRecord) -> Sample:
        if self.on_first_step is not None:
            first, self.on_first_step = self.on_first_step, None
            first()
        if self.cuda_possible and not self.cuda:
            self.check_cuda()
        if self.peak_pending:  # a GPU is there, but this step runs on the CPU
            self.find_peak(now=True)
        profile = self.profiler.due(self._recorder.steps_run)
        arrived = None
        if self.cuda and (self.count_flops_next or profile):
            # Before the sampling starts: the GPU's wait for this step ends here.
            arrived = event_now(self.torch.cuda)
        sample = _NOTHING_SAMPLED
        if self.count_flops_next or profile:
            counter = self._start_flop_count() if self.count_flops_next else None
            sample = (counter, self.profiler.start() if profile else None)
        start = time.perf_counter_ns()
        record.wall_start_ns = time.time_ns()
        record.start_ns = start
        if self.cuda:
            clock = DeviceClock(self.torch, arrived)
            if clock.start is not None:  # else a CUDA graph is being captured: host times
                record.gpu = clock
        self._recorder.current = record
        if self.drill is not None:
            self.drill.on_step_start(self._drill_host, record.step)
        self.schedule()
        return sample

    def exit(self, sample: Sample, record: StepRecord) -> int:
        counter, profiling = sample
        if self.drill is not None:
            self._drill_slowdown(record)
        if record.gpu is not None:
            record.gpu.end = record.gpu.now()
            if record.gpu.end is None:  # a CUDA graph capture began inside the step
                record.gpu = None
        end = time.perf_counter_ns()
        self._recorder.current = None
        record.duration_ns = end - record.start_ns
        if profiling is not None:
            record.profile = self.profiler.stop(profiling, record.step)
            record.note = "profiled step (slower): no MFU"
        if counter is not None:
            self._finish_flop_count(counter, record)
        sampled = counter is not None or profiling is not None
        if record.gpu is not None and sampled:
            record.gpu.settled = record.gpu.now()  # the sampling work is not the next step's wait
        if self.cuda_memory is not None:
            record.memory = self.cuda_memory()  # host-side counters: no sync
        # A sampled step's profiler stop or FLOP count is the agent's time, not the
        # loader's: the next step's data wait starts after it.
        return time.perf_counter_ns() if sampled else end

    # -- CUDA and the peak FLOP/s ---------------------------------------------------------

    def check_cuda(self) -> bool:
        """Whether the trainer has initialized CUDA (from then on, the agent uses it)."""
        torch = self.torch
        try:
            if not torch.cuda.is_initialized():
                return False
        except Exception:
            self.cuda_possible = False
            return False
        self.cuda = True
        self.cuda_memory = lambda: (
            torch.cuda.max_memory_allocated(),
            torch.cuda.memory_reserved(),
        )
        if self.peak_pending:
            self.find_peak(now=True)
        return True

    def forget_cuda(self) -> None:
        """In a child forked after CUDA was initialized: CUDA cannot be used there."""
        self.cuda = self.cuda_possible = self.peak_pending = False
        self.cuda_memory = None
        self.schedule()

    def find_peak(self, *, now: bool = False) -> None:
        """The device's peak FLOP/s: now, or (a GPU the trainer has not used yet) at the
        first step, once it is known whether the trainer runs on it or on the CPU."""
        if not now and self.cuda_possible and not self.cuda and not self.check_cuda():
            self.peak_pending = True
            self.schedule()
            return
        self.peak_pending = False
        self._encoder.peak = resolve_peak(
            self._config.dtype, local_rank=self._config.local_rank, cuda=self.cuda
        )

    # -- FLOPs counted once, on one step (tw.watch without flops_per_step/token) ----------

    def count_flops_on_next_step(self) -> None:
        if self._encoder.peak is None:
            self.find_peak()
        self.count_flops_next = True
        self.schedule()

    def _start_flop_count(self) -> Any:
        from torch.utils.flop_counter import FlopCounterMode  # torch: only once it is in use

        self.count_flops_next = False
        counter = FlopCounterMode(display=False)
        counter.__enter__()
        return counter

    def _finish_flop_count(self, counter: Any, record: StepRecord) -> None:
        counter.__exit__(None, None, None)
        flops = float(counter.get_total_flops())
        record.flops = flops
        record.note = "flops counted on this step (slower): no MFU"
        model = self._encoder.flop_model
        if record.tokens:
            model.per_token = flops / record.tokens
        else:
            model.per_step = flops
        model.source = "counted: FlopCounterMode over one step"

    # -- drills ---------------------------------------------------------------------------

    def use_drill(self, drill: Drill) -> None:
        """Run ``drill``'s faults at this process's step boundaries."""
        self.drill = drill
        self.schedule()

    def _drill_slowdown(self, record: StepRecord) -> None:
        factor = self.drill.slowdown(record.step) if self.drill else None
        if factor and factor > 1:
            worked = time.perf_counter_ns() - record.start_ns
            time.sleep((factor - 1) * worked / 1e9)  # the step really takes factor x as long
