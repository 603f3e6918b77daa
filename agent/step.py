"""``tw.step``: the training thread's hot path, and the record it fills.

A step talks to its agent through a :class:`Recorder`: where records go, the previous
step's end, the step in progress (which hooks and the heartbeat read), the commands'
flag and the flag of the rare work. The common path (a CPU step with no sampling due
and no drill) is, besides the two small objects (``Step``, ``StepRecord``)::

    enter: three clock reads (the data wait's end; the start, on the perf counter and
           the wall clock), one comparison (rare work due?)
    exit:  one check (did the step take the rare path?), two clock reads (the end, the
           time queued), the record onto the queue (:meth:`.sink.RecordQueue.put`:
           a ``deque.append``, no lock once ``attempt_start`` is queued), one attribute
           read (commands pending?)

Nothing waits on I/O or the device: tensors are kept, not read (:mod:`.values`). The
rare work (the CUDA clock and memory, the peak FLOP/s, a FLOP count, a profiler window,
a drill) sits behind that one comparison, in :mod:`.rare`; commands from the collector
(a rollback, a stop) run at the step boundary, in :mod:`.commands`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .datafeed import DataFeed
from .mixture import check_source, check_tokens
from .samples import take as take_samples
from .spikes import SpikeDetector
from .values import Captured, capture, check_metric_name, resolve_now

if TYPE_CHECKING:
    from .device_clock import DeviceClock


class StepRecord:
    __slots__ = (
        "kind",
        "step",
        "wall_start_ns",
        "start_ns",
        "duration_ns",
        "data_wait_ns",
        "tokens",
        "loss",
        "grad_norm",
        "phases",
        "comm",
        "flops",
        "memory",
        "profile",
        "error",
        "note",
        "metrics",
        "given",
        "replica",
        "probe",
        "samples",
        "epoch",
        "sources",
        "queued_at",
        "gpu",
    )

    def __init__(self, step: int, tokens: Any) -> None:
        self.kind = "step"
        self.step = step
        self.wall_start_ns = 0
        self.start_ns = 0
        self.duration_ns = 0
        self.data_wait_ns: int | None = None
        self.tokens = tokens
        self.loss: float | Captured | None = None
        self.grad_norm: float | Captured | None = None
        self.phases: list[tuple[str, int]] = []  # (phase, perf_counter_ns) marks
        self.comm: list[tuple[int, int]] = []  # (bucket ready, collective done) from the DDP hook
        self.flops: float | None = None  # counted on this step (FlopCounterMode)
        self.memory: tuple[int, int] | None = None  # CUDA (max allocated, reserved)
        self.profile: Any = None  # a sampled profiler window's results, analysed off-thread
        self.error: str | None = None
        self.note: str | None = None
        # s.metric(...): a dict only once a step uses it
        self.metrics: dict[str, float | Captured | None] | None = None
        # Built-in metrics the trainer gives (s.lr): a dict only once a step uses one
        self.given: dict[str, float | Captured | None] | None = None
        # A replica-checked step (tw.watch, replica.py): (the fingerprint's words, the group)
        self.replica: tuple[Captured, str] | None = None
        # A probed step (tw.watch, probe.py): (the probe's words, probe_rtol)
        self.probe: tuple[Captured, float] | None = None
        # s.samples(ids): the step's sample ids, read off this thread (samples.py)
        self.samples: Captured | None = None
        self.epoch: int | None = None  # their epoch (datafeed.py)
        # s.data_source(name, tokens): a dict only once a step uses it (mixture.py)
        self.sources: dict[str, int] | None = None
        self.queued_at = 0.0
        self.gpu: DeviceClock | None = None  # the step's CUDA events, once the trainer uses CUDA

    def mark(self, phase: str) -> None:
        """A phase starts now (on the GPU's clock too, when the step has one)."""
        self.phases.append((phase, time.perf_counter_ns()))
        if self.gpu is not None:
            self.gpu.marks.append(self.gpu.now())


class Boundary(Protocol):
    """Work that waits for a step boundary (:class:`.commands.Commands`)."""

    pending: bool
    """Read after every step: anything to do?"""

    def at_boundary(self, finished: int) -> None: ...


class RarePath(Protocol):
    """A step's entry and exit with the rare work (:class:`.rare.RareWork`)."""

    def enter(self, record: StepRecord) -> object:
        """Start the step: its start stamps and ``Recorder.current``, with the rare work
        around them; returns what :meth:`exit` needs (never None)."""
        ...

    def exit(self, sample: Any, record: StepRecord) -> int:
        """End the step: its duration and ``Recorder.current`` cleared, with the rare work
        around them; returns the time (``perf_counter_ns``) the next step's data wait
        counts from."""
        ...


class Recorder:
    """What a step needs of its agent, and all it touches. One per agent.

    The training thread writes the step fields; the exporter thread (heartbeats) and
    the hooks of :mod:`.watch` read them. ``rare_from`` is the flag of the rare work: the
    step count (``steps_run``) from which steps take ``rare``'s path; 0 for every step,
    ``sys.maxsize`` for none (:class:`.rare.RareWork` attaches itself and keeps it).
    """

    rare: RarePath

    __slots__ = (
        "enqueue",
        "boundary",
        "skip_spikes",
        "rare",
        "rare_from",
        "steps_run",
        "current",
        "last_end_ns",
        "last_step",
        "last_step_wall",
        "last_error",
        "data",
    )

    def __init__(self, enqueue: Callable[[Any], None], boundary: Boundary) -> None:
        self.enqueue = enqueue
        """Where a finished step's record goes (the agent's queue)."""
        self.boundary = boundary
        self.skip_spikes = SpikeDetector()  # s.should_skip_step(), on the training thread
        self.rare_from = sys.maxsize  # no rare path until one is attached
        self.steps_run = 0  # steps this process entered: the profiler's cadence counts them
        self.current: StepRecord | None = None  # the step in progress; hooks write into it
        self.last_end_ns: int | None = None  # where the next step's data wait starts
        self.last_step: int | None = None
        self.last_step_wall: float | None = None  # its end, on the wall clock
        self.last_error: str | None = None  # the exception that ended the last step, if any
        self.data = DataFeed(lambda epoch, step, facts: None)  # the agent sets its own


class Step:
    """One training step. Use as ``with tw.step(i, tokens=n) as s: ... s.loss(loss)``."""

    __slots__ = ("_recorder", "_record", "_sample")

    def __init__(self, recorder: Recorder, step: int, tokens: Any) -> None:
        self._recorder = recorder
        if tokens is not None and not isinstance(tokens, int):
            try:
                tokens = int(tokens)  # a tensor's numel() or a numpy int; a CUDA tensor would sync
            except (TypeError, ValueError):
                tokens = None
        self._record = StepRecord(int(step), tokens)
        self._sample: object = None  # what the rare path's exit needs, if the step took it

    def __enter__(self) -> Step:
        recorder = self._recorder
        record = self._record
        entered = time.perf_counter_ns()
        if recorder.last_end_ns is not None:
            # The gap since the previous step ended: the trainer's loader, not our sampling.
            record.data_wait_ns = entered - recorder.last_end_ns
        recorder.steps_run += 1
        if recorder.steps_run >= recorder.rare_from:  # CUDA, sampling, a drill: rare.py
            self._sample = recorder.rare.enter(record)
            return self
        record.wall_start_ns = time.time_ns()
        record.start_ns = time.perf_counter_ns()
        recorder.current = record
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        recorder = self._recorder
        record = self._record
        if self._sample is not None:
            settled = recorder.rare.exit(self._sample, record)
        else:
            settled = time.perf_counter_ns()
            recorder.current = None
            record.duration_ns = settled - record.start_ns
        record.queued_at = time.monotonic()
        if exc_type is not None:
            record.error = exc_type.__name__
            recorder.last_error = f"{exc_type.__name__}: {str(exc)[:300]}"
        else:
            recorder.last_error = None
        recorder.last_end_ns = settled
        if recorder.data.fed is not None:  # a watched loader's batches (loader.py)
            _take_fed(recorder.data, record)
        recorder.last_step = record.step
        recorder.last_step_wall = (record.wall_start_ns + record.duration_ns) / 1e9
        recorder.enqueue(record)
        if recorder.boundary.pending:  # a rollback or a stop from the collector
            recorder.boundary.at_boundary(record.step)

    def loss(self, value: Any) -> None:
        """Record this rank's loss: a tensor (read later, off this thread) or a number."""
        self._record.loss = capture(value)

    def grad_norm(self, value: Any) -> None:
        """Record the global gradient norm (e.g. what ``clip_grad_norm_`` returned)."""
        self._record.grad_norm = capture(value)

    def lr(self, value: Any) -> None:
        """Record the learning rate this step's update used (a number, or a tensor read
        later, as for ``loss``): the built-in series ``lr``. The Hugging Face, Lightning and
        Accelerate integrations record it for you."""
        self._give("lr", value)

    def _give(self, field: str, value: Any) -> None:
        given = self._record.given
        if given is None:
            given = self._record.given = {}
        given[field] = capture(value)

    def metric(self, name: str, value: Any) -> None:
        """Record a scalar of your own for this step (learning rate, eval loss, an aux loss).

        ``value``: a tensor (read later, off this thread, as for ``loss``) or a number;
        NaN and Inf are kept as such. ``name`` matches ``^[a-z][a-z0-9_.]{0,31}$``, at most
        32 names a step: a bad one raises ``ValueError`` here. The collector keeps it
        across ranks as series ``user.<name>``.
        """
        metrics = self._record.metrics
        if metrics is None:
            metrics = self._record.metrics = {}
        if name not in metrics:
            check_metric_name(name, len(metrics))
        metrics[name] = capture(value)

    def metrics(self, **values: Any) -> None:
        """Several user metrics at once: ``s.metrics(lr=lr, aux_loss=aux)`` (see :meth:`metric`)."""
        for name, value in values.items():
            self.metric(name, value)

    def samples(self, ids: Any, *, epoch: int | None = None) -> None:
        """Record the ids of the samples this rank trained on in this step: an integer
        tensor, a numpy array or a list / tuple / range of ints (dataset indices, or any
        stable id), in the order trained. Only a reference is kept here (a short copy for a
        list); the exporter thread digests them. The collector finds a batch that two ranks
        both trained on, and a step run again on other samples. A float tensor, anything
        but ints, or over 65,536 ids raises ``ValueError`` here
        (:mod:`trainwarden.agent.samples`).

        ``epoch``: the epoch these samples belong to (the last one given when omitted,
        first 0). A step in a new epoch ends the one before, as :func:`end_epoch` does:
        with a dataset size (``tw.init(dataset_size=N)``) the collector then counts the
        epoch's repeated and missing samples."""
        record = self._record
        record.samples = take_samples(ids)
        record.epoch = self._recorder.data.at(record.step, epoch)

    def data_source(self, name: str, tokens: Any) -> None:
        """Record that ``tokens`` of this step's tokens came from data source ``name``
        (one call per source the step drew from). With ``tw.init(data_mixture=...)`` the
        collector compares the realized shares with the declared ones. A bad name or a
        count that is not a whole number >= 0 raises ``ValueError`` here."""
        sources = self._record.sources
        if sources is None:
            sources = self._record.sources = {}
        if name not in sources:
            check_source(name, len(sources))
        sources[name] = sources.get(name, 0) + check_tokens(name, tokens)

    def phase(self, name: str) -> None:
        """Mark the start of a phase: ``forward``, ``backward``, ``optimizer`` or ``other``.

        The manual alternative to ``tw.watch``: a phase lasts until the next mark.
        """
        self._record.mark(name)

    def should_skip_step(self) -> bool:
        """True when this step's gradient norm is non-finite or over 20x its running mean.

        **This synchronizes with the device** to read the norm (``.item()``): call it only
        when you act on the answer (skip ``optimizer.step()``), not for telemetry. Call it
        on every step: its running mean is built from the norms it is shown (after a
        warm-up of 20 steps). Needs ``s.grad_norm(...)`` or ``tw.watch(..., grad_norm=True)``.
        """
        value = self._record.grad_norm
        if value is None:
            return False
        number = value if isinstance(value, float) else resolve_now(value)
        if number is None:
            return False
        flags = self._recorder.skip_spikes.observe(loss=None, grad_norm=number)
        return "skip_suggested" in flags or "nonfinite_grad_norm" in flags

    @property
    def step(self) -> int:
        return self._record.step


def _take_fed(data: DataFeed, record: StepRecord) -> None:
    """At a step's end: the batches a watched loader fed since the last step are its
    samples, unless the step gave its own (``s.samples``)."""
    captured, epoch = data.take_fed()
    if record.samples is None:
        record.samples = captured
        record.epoch = data.at(record.step, epoch)
