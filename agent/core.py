"""The per-process agent and the ``tw.step`` context manager.

Hot path (``Step.__enter__`` / ``__exit__``): two clock reads, one small object, one
``deque.append``. No locks, no I/O, no device sync; everything else happens on the
exporter thread.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections import deque
from typing import Any
from urllib.parse import urlsplit

from . import identity
from .checkpoints import Checkpointing, checked_seconds, checked_step, checkpoint_data
from .commands import Commands
from .config import AgentConfig, ConfigError
from .device_clock import DeviceClock, event_now
from .drills import Drill, DrillError, parse
from .exporter import Exporter, HttpTransport, Transport
from .gpu import XID_SEVERITY, GpuMonitor, describe_xid, open_device
from .mfu import Peak, resolve_peak
from .profiler import SampledProfiler
from .report import FlopModel, StepEncoder
from .spikes import SpikeDetector
from .spool import DiskSpool, MemorySpool, Spool, default_spool_dir
from .values import Captured, capture, check_metric_name, resolve_now

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
_SHUTDOWN_TIMEOUT_S = 5.0
# Records wait (at most this long, in memory) behind the attempt_start event, so that the
# collector learns which attempt a process is before its first step.
_FIRST_EVENT_WAIT_S = 1.0
_IDENTITY_WAIT_AT_EXIT_S = 2.0
_CHECKPOINT_SIZE_WAIT_AT_EXIT_S = 1.0
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # what a shell, Slurm or Kubernetes reports: 143


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
        self.queued_at = 0.0
        self.gpu: DeviceClock | None = None  # the step's CUDA events, once the trainer uses CUDA

    def mark(self, phase: str) -> None:
        """A phase starts now (on the GPU's clock too, when the step has one)."""
        self.phases.append((phase, time.perf_counter_ns()))
        if self.gpu is not None:
            self.gpu.marks.append(self.gpu.now())


class EventRecord:
    __slots__ = ("kind", "body", "queued_at")

    def __init__(self, body: dict[str, Any]) -> None:
        self.kind = "event"
        self.body = body
        self.queued_at = time.monotonic()


class GpuRecord:
    __slots__ = ("kind", "body", "queued_at")

    def __init__(self, body: dict[str, Any]) -> None:
        self.kind = "gpu"
        self.body = body
        self.queued_at = time.monotonic()


class Step:
    """One training step. Use as ``with tw.step(i, tokens=n) as s: ... s.loss(loss)``."""

    __slots__ = ("_agent", "_record", "_counter", "_profiling")

    def __init__(self, agent: Agent, step: int, tokens: Any) -> None:
        self._agent = agent
        if tokens is not None and not isinstance(tokens, int):
            try:
                tokens = int(tokens)  # a tensor's numel() or a numpy int; a CUDA tensor would sync
            except (TypeError, ValueError):
                tokens = None
        self._record = StepRecord(int(step), tokens)
        self._counter: Any = None
        self._profiling: Any = None

    def __enter__(self) -> Step:
        entered = time.perf_counter_ns()
        agent = self._agent
        record = self._record
        last_end = agent._last_step_end_ns
        if last_end is not None:
            # The gap since the previous step ended: the trainer's loader, not our sampling.
            record.data_wait_ns = entered - last_end
        if agent._cuda_possible and not agent._cuda:
            agent._check_cuda()
        if agent._peak_pending:  # a GPU is there, but this step runs on the CPU
            agent._resolve_peak(now=True)
        arrived = None
        if agent._cuda and (agent._count_flops_next or agent._profiler.due(agent._steps_run + 1)):
            arrived = event_now(agent._torch.cuda)
        if agent._count_flops_next:
            self._counter = agent._start_flop_count()
        agent._steps_run += 1
        if agent._profiler.due(agent._steps_run):
            self._profiling = agent._profiler.start()
        t0 = time.perf_counter_ns()
        record.wall_start_ns = time.time_ns()
        record.start_ns = t0
        if agent._cuda:
            clock = DeviceClock(agent._torch, arrived)
            if clock.start is not None:  # else a CUDA graph is being captured: host times
                record.gpu = clock
        agent._current = record
        if agent._drill is not None:
            agent._drill.on_step_start(agent, record.step)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        record = self._record
        agent = self._agent
        if agent._drill is not None:
            agent._drill_slowdown(record)
        if record.gpu is not None:
            record.gpu.end = record.gpu.now()
            if record.gpu.end is None:  # a CUDA graph capture began inside the step
                record.gpu = None
        t1 = time.perf_counter_ns()
        agent._current = None
        record.duration_ns = t1 - record.start_ns
        if exc_type is not None:
            record.error = exc_type.__name__
            agent._last_error = f"{exc_type.__name__}: {str(exc)[:300]}"
        if self._profiling is not None:
            record.profile = agent._profiler.stop(self._profiling, record.step)
            record.note = "profiled step (slower): no MFU"
        if self._counter is not None:
            agent._finish_flop_count(self._counter, record)
        if record.gpu is not None and (self._profiling is not None or self._counter is not None):
            record.gpu.settled = record.gpu.now()  # the sampling work is not the next step's wait
        if agent._cuda_memory is not None:
            record.memory = agent._cuda_memory()  # host-side counters: no sync
        record.queued_at = time.monotonic()
        # A sampled step's profiler stop or FLOP count is the agent's time, not the
        # loader's: the next step's data wait starts after it.
        sampled = self._profiling is not None or self._counter is not None
        agent._last_step_end_ns = time.perf_counter_ns() if sampled else t1
        agent._last_step = record.step
        if exc_type is None:
            agent._last_error = None
        agent._last_step_wall = (record.wall_start_ns + record.duration_ns) / 1e9
        agent._enqueue(record)
        if agent.commands.pending:  # a rollback or a stop from the collector
            agent.commands.at_boundary(record.step)

    def loss(self, value: Any) -> None:
        """Record this rank's loss: a tensor (read later, off this thread) or a number."""
        self._record.loss = capture(value)

    def grad_norm(self, value: Any) -> None:
        """Record the global gradient norm (e.g. what ``clip_grad_norm_`` returned)."""
        self._record.grad_norm = capture(value)

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
        flags = self._agent.skip_spikes.observe(loss=None, grad_norm=number)
        return "skip_suggested" in flags or "nonfinite_grad_norm" in flags

    @property
    def step(self) -> int:
        return self._record.step


class Agent:
    """One per process. Created by ``tw.init``; the module functions delegate to it."""

    def __init__(self, config: AgentConfig, *, transport: Transport | None = None) -> None:
        self.config = config
        self.session_id = uuid.uuid4().hex
        self.started_at = time.time()
        self._last_step_end_ns: int | None = None
        self._last_step: int | None = None
        self._last_step_wall: float | None = None
        self._last_error: str | None = None  # the exception that ended the last step, if any
        self._current: StepRecord | None = None  # the step in progress; hooks write into it
        self._count_flops_next = False
        self._steps_run = 0
        self._profiler = SampledProfiler(every=config.profile_every, profile_dir=config.profile_dir)
        self._cuda_memory: Any = None
        self.spikes = SpikeDetector()  # exporter thread: flags on every step
        self.skip_spikes = SpikeDetector()  # training thread: s.should_skip_step()
        self.flop_model = FlopModel()
        if config.flops_per_step is not None:
            self.flop_model = FlopModel(
                per_step=config.flops_per_step, source="given: flops_per_step"
            )
        elif config.flops_per_token is not None:
            self.flop_model = FlopModel(
                per_token=config.flops_per_token, source="given: flops_per_token"
            )
        # CUDA: the agent never initializes it. While a GPU is there but the trainer has
        # not used it yet, each step asks (_check_cuda); from the first step after it has,
        # steps run on the GPU's clock and report CUDA memory, and the peak is the GPU's.
        self._torch: Any = sys.modules.get("torch")
        self._cuda = False
        self._cuda_possible = False
        if self._torch is not None:
            try:
                self._cuda_possible = bool(self._torch.cuda.is_available())
            except Exception:  # a broken driver: no CUDA for the agent
                self._cuda_possible = False
        self._peak_pending = False
        self.peak: Peak | None = Peak(config.peak_flops, "given") if config.peak_flops else None
        if self.peak is None and self.flop_model.source is not None:
            self._resolve_peak()
        self._encode = StepEncoder(spikes=self.spikes, flop_model=self.flop_model, peak=self.peak)
        self._queue: deque[Any] = deque()
        self._local: deque[Any] = deque(maxlen=config.queue_size)
        self.stats = {
            "recorded": 0,
            "dropped_queue_full": 0,
            "sent": 0,
            "batches_sent": 0,
            "batches_failed": 0,
            "batches_refused_auth": 0,  # 401/403: a missing or wrong token; records are kept
            "dropped_send_failed": 0,
            "exporter_cpu_ns": 0,
            "heartbeats": 0,
            "retries": 0,
            "dropped_at_shutdown": 0,
            "spooled": 0,  # records put in the spool while the collector was away
            "replayed": 0,  # records sent from the spool once it was back
            "spooled_from_earlier": 0,  # batches an earlier process left in the spool
            "dropped_spool_full": 0,
            "dropped_spool_failed": 0,
            "dropped_spool_unreadable": 0,
        }
        self._exporter: Exporter | None = None
        self._relay: Any = None  # the node's relay, when this agent runs it (relay="auto")
        self.commands = Commands(self)
        if transport is None and config.url is not None and config.exporter == "otlp":
            from .otlp import OtlpTransport  # OpenTelemetry only when asked for

            transport = OtlpTransport(
                config.url, token=config.token, timeout_s=config.request_timeout_s
            )
        elif transport is None and config.url is not None:
            relay = config.relay
            if relay == "auto":
                relay, self._relay = _node_relay(config)
            transport = HttpTransport(
                config.url, token=config.token, timeout_s=config.request_timeout_s, relay=relay
            )
        if transport is not None:
            self._exporter = Exporter(
                queue=self._queue,
                header=self._header,
                encode=self._encode,
                transport=transport,
                run=config.run,
                batch_size=config.batch_size,
                interval_s=config.flush_interval_s,
                heartbeat_s=config.heartbeat_s,
                stats=self.stats,
                on_commands=self.commands.receive,
                spool=self._open_spool(),
                # With a relay, the node's ranks send together: it merges them.
                phase_of=None if config.relay is None else _relay_group(config),
            )
        else:
            log.warning(
                "trainwarden: no collector URL (tw.init(url=...) or TRAINWARDEN_URL); "
                "keeping the last %d records in memory only",
                config.queue_size,
            )
        self._closed = False
        # Until attempt_start is queued, records are held back (see _hold); one attribute
        # read on the hot path once it is.
        self._gate_lock = threading.Lock()
        self._held: deque[Any] = deque()
        self._gated = self._exporter is not None
        self._gate_deadline = time.monotonic() + _FIRST_EVENT_WAIT_S
        self._identity_thread: threading.Thread | None = None
        self._identity = identity.skeleton(config)
        self._attempt_started = False
        self._attempt_lock = threading.Lock()
        self._end: tuple[str, str, int | None] = ("completed", "", None)
        self._checkpoints: set[Checkpointing] = set()  # sizes still being measured
        self.gpu_device: Any = None
        self.gpu_monitor: GpuMonitor | None = None
        self.event("start", pid=os.getpid(), world_size=config.world_size)
        self._drill = None
        if config.drill:
            try:
                self._drill = Drill(
                    parse(config.drill), rank=config.rank, world_size=config.world_size
                )
            except DrillError as exc:
                self.shutdown(timeout_s=0.5)
                raise ConfigError(str(exc)) from None
        self._start_gpu_monitor(simulate=bool(self._drill and self._drill.needs_gpu))
        self._identity_thread = threading.Thread(
            target=self._collect_identity, name="trainwarden-identity", daemon=True
        )
        self._identity_thread.start()
        # Opening NVML can take a while: the wait for attempt_start counts from here.
        self._gate_deadline = time.monotonic() + _FIRST_EVENT_WAIT_S

    # -- run identity: the attempt_start event -------------------------------------------

    def _collect_identity(self) -> None:
        try:
            identity.collect(self.config, self._identity, gpu_device=self.gpu_device)
        except Exception:  # never the trainer's problem: the fields stay None
            log.debug("trainwarden: identity collection failed", exc_info=True)
        self._start_attempt()

    def _start_attempt(self) -> None:
        """Queue ``attempt_start`` (once), ahead of every record held back so far."""
        with self._attempt_lock:
            if self._attempt_started:
                return
            self._attempt_started = True
            data = copy.deepcopy(self._identity)  # the identity thread may still be filling it
        self.stats["recorded"] += 1
        record = EventRecord(self._event_body("attempt_start", None, "info", data, self.started_at))
        self._open_gate(record)
        self.flush_soon()

    def end_reason(self, reason: str, detail: str = "", exit_code: int | None = None) -> None:
        """How this process is ending (``attempt_end``'s reason), said before it shuts down."""
        self._end = (reason, detail[:300], exit_code)

    def note_exit_in_flight(self) -> None:
        """``tw.shutdown()`` in a ``finally`` while an exception propagates: that exception
        ends the attempt; ``sys.exit(n)`` ends it ``completed`` with its code."""
        exc = sys.exc_info()[1]
        if exc is None or self._end[0] != "completed":
            return
        if isinstance(exc, SystemExit):
            code = exc.code
            self._end = (
                "completed",
                "",
                0 if code is None else code if isinstance(code, int) else 1,
            )
        else:
            code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
            self.end_reason("exception", f"{type(exc).__name__}: {exc}", code)

    def _open_spool(self) -> Spool:
        """The disk spool of this run and rank; in memory if the directory is unusable."""
        c = self.config
        if c.spool_dir is not None and c.spool_dir.strip().lower() in ("", "none", "off"):
            return MemorySpool(max_records=c.queue_size, stats=self.stats)
        directory = os.path.join(c.spool_dir or default_spool_dir(), c.run, f"rank-{c.rank}")
        try:
            return DiskSpool(directory, max_bytes=c.spool_max_bytes, stats=self.stats)
        except OSError as exc:
            log.warning(
                "trainwarden: cannot use the spool directory %s (%s); "
                "batches wait in memory while the collector is away",
                directory,
                exc,
            )
            return MemorySpool(max_records=c.queue_size, stats=self.stats)

    # -- GPU health ---------------------------------------------------------------

    def _start_gpu_monitor(self, *, simulate: bool) -> None:
        if self.config.gpu_interval_s == 0 and not simulate:
            self.event("gpu_telemetry", state="off", reason="gpu_interval_s=0")
            return
        device, reason = open_device(self.config.local_rank, simulate=simulate)
        if device is None:
            log.info("trainwarden: no GPU telemetry (%s)", reason)
            self.event("gpu_telemetry", state="unavailable", reason=reason)
            return
        self.gpu_device = device
        self.event(
            "gpu_telemetry",
            state="ok",
            uuid=device.uuid,
            name=device.name,
            simulated=device.simulated,
        )
        self.gpu_monitor = GpuMonitor(
            device,
            interval_s=self.config.gpu_interval_s,
            on_sample=lambda sample: self._enqueue(GpuRecord(sample)),
            on_xid=self._on_xid,
        )
        self.gpu_monitor.start()

    def _on_xid(self, code: int) -> None:
        info = describe_xid(code)
        device = self.gpu_device
        self.event(
            "xid",
            step=self._last_step,
            severity=XID_SEVERITY.get(info["action"], "warning"),
            code=code,
            gpu_uuid=getattr(device, "uuid", None),
            host=self.config.host,
            node=self.config.node,
            simulated=getattr(device, "simulated", False),
            **info,
        )
        self.flush_soon()

    # -- drills -------------------------------------------------------------------

    def _drill_slowdown(self, record: StepRecord) -> None:
        factor = self._drill.slowdown(record.step) if self._drill else None
        if factor and factor > 1:
            worked = time.perf_counter_ns() - record.start_ns
            time.sleep((factor - 1) * worked / 1e9)  # the step really takes factor x as long

    def flush_soon(self) -> None:
        if self._exporter is not None:
            self._exporter.wake()

    def poll_soon(self) -> None:
        """Ask the collector for commands now (a heartbeat, if nothing else is queued)."""
        if self._exporter is not None:
            self._exporter.poll_soon()

    def flush(self, timeout_s: float) -> None:
        """Send what is queued now, waiting at most ``timeout_s``."""
        if self._gated:
            self._wait_for_identity(min(timeout_s / 2, _FIRST_EVENT_WAIT_S))
            self._open_gate(None)
        if self._exporter is not None:
            self._exporter.flush(timeout_s)

    def _wait_for_identity(self, timeout_s: float) -> None:
        thread = self._identity_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout_s))

    def _header(self) -> dict[str, Any]:
        c = self.config
        return {
            "rank": c.rank,
            "world_size": c.world_size,
            "local_rank": c.local_rank,
            "host": c.host,
            "node": c.node,
            "pid": os.getpid(),
            "session": self.session_id,
            "started_at": self.started_at,
            "version": AGENT_VERSION,
            "sent_at": time.time(),
            # Heartbeat: what the training thread is doing right now, so the collector
            # can tell a hung rank (beats, no progress) from a dead one (no beats).
            "heartbeat_s": c.heartbeat_s,
            "last_step": self._last_step,
            "last_step_end": self._last_step_wall,
            "in_step": self._current is not None,
            "phase": self._phase_now(),
        }

    def _phase_now(self) -> str | None:
        record = self._current
        if record is None:
            return None
        phases = record.phases
        return phases[-1][0] if phases else "step"

    def _enqueue(self, record: Any) -> None:
        self.stats["recorded"] += 1
        if self._gated and self._hold(record):
            return
        self._put(record)

    def _hold(self, record: Any) -> bool:
        """Hold ``record`` back while attempt_start is not queued yet (True), for at most
        ``_FIRST_EVENT_WAIT_S``: then the records go out without waiting for it."""
        if time.monotonic() >= self._gate_deadline:
            self._open_gate(None)
            return False
        with self._gate_lock:
            if not self._gated:
                return False
            held = self._held
            if len(held) >= self.config.queue_size:
                held.popleft()
                self.stats["dropped_queue_full"] += 1
            held.append(record)
            return True

    def _open_gate(self, first: Any) -> None:
        """Queue ``first`` (if any), then what was held back, in order. ``_gated`` turns
        False only once they are all queued: a record that comes meanwhile waits on the
        lock and goes behind them."""
        with self._gate_lock:
            if self._gated:
                if first is not None:
                    self._put(first)
                while self._held:
                    self._put(self._held.popleft())
                self._gated = False
                return
        if first is not None:
            self._put(first)  # it came late: as soon as it is ready

    def _put(self, record: Any) -> None:
        if self._exporter is None:
            self._local.append(record)
            return
        queue = self._queue
        if len(queue) >= self.config.queue_size:
            # Drop the oldest, as OpenTelemetry's BatchProcessor does, and count it.
            try:
                queue.popleft()
                self.stats["dropped_queue_full"] += 1
            except IndexError:  # the exporter emptied it meanwhile
                pass
        queue.append(record)
        if len(queue) >= self.config.batch_size:
            self._exporter.wake()

    # -- FLOPs counted once, on one step (tw.watch without flops_per_step/token) --------

    def count_flops_on_next_step(self) -> None:
        if self.peak is None:
            self._resolve_peak()
        self._count_flops_next = True

    def _resolve_peak(self, *, now: bool = False) -> None:
        """The device's peak FLOP/s: now, or (a GPU the trainer has not used yet) at the
        first step, once it is known whether the trainer runs on it or on the CPU."""
        if not now and self._cuda_possible and not self._cuda and not self._check_cuda():
            self._peak_pending = True
            return
        self._peak_pending = False
        self.peak = resolve_peak(
            self.config.dtype, local_rank=self.config.local_rank, cuda=self._cuda
        )
        if hasattr(self, "_encode"):
            self._encode.peak = self.peak

    def _check_cuda(self) -> bool:
        """Whether the trainer has initialized CUDA (from then on, the agent uses it)."""
        torch = self._torch
        try:
            if not torch.cuda.is_initialized():
                return False
        except Exception:
            self._cuda_possible = False
            return False
        self._cuda = True
        self._cuda_memory = lambda: (
            torch.cuda.max_memory_allocated(),
            torch.cuda.memory_reserved(),
        )
        if self._peak_pending:
            self._resolve_peak(now=True)
        return True

    def _start_flop_count(self) -> Any:
        from torch.utils.flop_counter import FlopCounterMode

        self._count_flops_next = False
        counter = FlopCounterMode(display=False)
        counter.__enter__()
        return counter

    def _finish_flop_count(self, counter: Any, record: StepRecord) -> None:
        counter.__exit__(None, None, None)
        flops = float(counter.get_total_flops())
        record.flops = flops
        record.note = "flops counted on this step (slower): no MFU"
        if record.tokens:
            self.flop_model.per_token = flops / record.tokens
        else:
            self.flop_model.per_step = flops
        self.flop_model.source = "counted: FlopCounterMode over one step"

    def step(self, step: int, tokens: Any = None) -> Step:
        return Step(self, step, tokens)

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None:
        """Queue an event (restart, shutdown, ...). Cheap; safe from any thread."""
        self._enqueue(EventRecord(self._event_body(kind, step, severity, data, None)))

    def event_at(
        self, ts: float, kind: str, *, step: int | None, severity: str, data: dict[str, Any]
    ) -> None:
        """An event of an earlier moment ``ts`` (wall clock), queued now."""
        self._enqueue(EventRecord(self._event_body(kind, step, severity, data, ts)))

    @staticmethod
    def _event_body(
        kind: str, step: int | None, severity: str, data: dict[str, Any], ts: float | None
    ) -> dict[str, Any]:
        return {
            "id": uuid.uuid4().hex,
            "kind": kind,
            "ts": time.time() if ts is None else ts,
            "step": step,
            "severity": severity,
            "data": data,
        }

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoint_saved(
        self,
        step: int,
        path: Any,
        *,
        seconds: float | None = None,
        bytes: int | None = None,  # noqa: A002 - the public keyword
        drain_seconds: float | None = None,
        **meta: Any,
    ) -> None:
        step = checked_step(step)
        data = checkpoint_data(
            path, seconds=seconds, bytes=bytes, drain_seconds=drain_seconds, meta=meta
        )
        self.event_at(time.time(), "checkpoint", step=step, severity="info", data=data)

    def checkpointing(self, step: int, path: Any = None) -> Checkpointing:
        return Checkpointing(self, checked_step(step), path)

    def checkpoint_drained(self, step: int, seconds: float, path: Any = None) -> None:
        step = checked_step(step)
        drain = checked_seconds(seconds, "seconds")
        if drain is None:
            raise TypeError("seconds must be a number of seconds, got None")
        self.event(
            "checkpoint_drained",
            step=step,
            path=None if path is None else os.fspath(path),
            drain_seconds=drain,
        )

    def recent(self, n: int = 100) -> list[Any]:
        """The last ``n`` records kept locally (only when there is no collector)."""
        return list(self._local)[-n:]

    def shutdown(self, timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> None:
        if self._closed:
            return
        self._closed = True
        started = time.monotonic()
        if self._identity_thread is not None:
            # attempt_start goes out before the goodbye: with what is known by now.
            self._wait_for_identity(min(timeout_s / 2, _IDENTITY_WAIT_AT_EXIT_S))
            self._start_attempt()
        self._open_gate(None)
        self._finish_checkpoints(min(timeout_s / 4, _CHECKPOINT_SIZE_WAIT_AT_EXIT_S))
        # An exception that left a step and was never followed by a good step is how
        # this process ends: report it, so the collector marks the rank failed.
        if self._last_error is not None:
            self.event(
                "shutdown", step=self._last_step, severity="critical", error=self._last_error
            )
        else:
            self.event("shutdown", step=self._last_step)
        if self._identity_thread is not None:
            reason, detail, exit_code = self._end
            if reason == "completed" and self._last_error is not None:
                reason, detail = "exception", self._last_error  # it left a step, and ends us
            self.event(
                "attempt_end",
                step=None,
                reason=reason,
                detail=detail,
                exit_code=exit_code,
                last_step=self._last_step,
            )
        if self.gpu_monitor is not None:
            self.gpu_monitor.stop()
        if self._exporter is not None:
            self._exporter.shutdown(max(0.1, timeout_s - (time.monotonic() - started)))
        if self._relay is not None:  # what it holds goes on; the node's others go direct
            self._relay.stop()

    def _finish_checkpoints(self, timeout_s: float) -> None:
        """Checkpoints whose size is still being measured go out now, with it if it comes
        within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for ck in list(self._checkpoints):
            ck.finish(wait_s=max(0.0, deadline - time.monotonic()))


def _relay_group(config: AgentConfig) -> str:
    """Who sends through the same relay, whose agents share a flush phase: the node, for
    a relay on it (``auto``, loopback); for one that serves several nodes, its URL."""
    host = urlsplit(config.relay).hostname if config.relay not in (None, "auto") else None
    if host is None or host == "localhost" or host.startswith("127.") or host == "::1":
        return config.node
    return str(config.relay)


def _node_relay(config: AgentConfig) -> tuple[str, Any]:
    """``relay="auto"``: the node relay's URL, on ``relay_port`` (8470), and
    the relay itself where this agent runs it: local rank 0's does, waiting for
    ``LOCAL_WORLD_SIZE`` ranks. A port already taken (another job's relay: the agents
    check whom a relay sends to) leaves it to that one."""
    from .relay import Relay

    port = config.relay_port
    url = f"http://127.0.0.1:{port}"
    if config.local_rank != 0 or config.url is None:
        return url, None
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    try:
        relay = Relay(config.url, port=port, expect=int(local) if local.isdigit() else None)
    except OSError as exc:
        log.info("trainwarden: no node relay started on port %d (%s)", port, exc)
        return url, None
    return url, relay.start()


_agent: Agent | None = None
_atexit_registered = False


def current() -> Agent:
    if _agent is None:
        raise RuntimeError("trainwarden: call tw.init(run=...) before tw.step(...)")
    return _agent


def set_current(agent: Agent | None) -> None:
    global _agent, _atexit_registered
    if agent is not None and not _atexit_registered:
        atexit.register(_flush_at_exit)
        _atexit_registered = True
    _agent = agent


def _forget_in_child() -> None:
    """After ``fork`` (DataLoader workers): the child has none of the agent's threads and
    is not the rank; its agent keeps records in memory only and never reports, so a
    worker's exit is not the rank's shutdown."""
    if _agent is not None:
        _agent._exporter = None
        _agent.gpu_monitor = None
        _agent._closed = True
        _agent._gate_lock = threading.Lock()  # another thread may have held it at the fork
        _agent._gated = False
        # CUDA cannot be used in a child forked after it was initialized: no GPU clock.
        _agent._cuda = _agent._cuda_possible = _agent._peak_pending = False
        _agent._cuda_memory = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)

_previous_sigterm: Any = None


def install_sigterm_flush() -> bool:
    """On SIGTERM (a scheduler's preemption, a launcher stopping the job), flush within
    a deadline (what cannot be sent goes to the spool), then die of the signal as the
    process would have. Only when SIGTERM has no handler yet and from the main thread:
    the agent never takes a handler the trainer installed."""
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return False
    current_handler = signal.getsignal(signal.SIGTERM)
    if current_handler is _on_sigterm:
        return True
    if current_handler is not signal.SIG_DFL:
        return False
    _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def _on_sigterm(signum: int, frame: Any) -> None:
    agent = _agent
    if agent is not None and not agent._closed:
        log.warning(
            "trainwarden: SIGTERM; flushing (at most %.0fs) before exiting", _SHUTDOWN_TIMEOUT_S
        )
        try:
            agent.event("signal", step=agent._last_step, severity="warning", signal="SIGTERM")
            agent.end_reason("sigterm", "SIGTERM", SIGTERM_EXIT_CODE)
            agent.shutdown(timeout_s=_SHUTDOWN_TIMEOUT_S)
        except Exception:
            log.exception("trainwarden: flush on SIGTERM failed")
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die of it, as without the agent


_previous_excepthook: Any = None


def install_excepthook() -> None:
    """Chain ``sys.excepthook``: an uncaught exception that ends the main thread is the
    attempt's end reason (the atexit flush that follows sends it)."""
    global _previous_excepthook
    if _previous_excepthook is None:
        _previous_excepthook = sys.excepthook
        sys.excepthook = _on_uncaught


def _on_uncaught(exc_type: Any, exc: Any, tb: Any) -> None:
    agent = _agent
    # At an interactive prompt an exception does not end the process.
    if agent is not None and not agent._closed and not hasattr(sys, "ps1"):
        try:
            code = 128 + signal.SIGINT if issubclass(exc_type, KeyboardInterrupt) else 1
            agent.end_reason("exception", f"{exc_type.__name__}: {exc}", code)
        except Exception:
            pass
    (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def _flush_at_exit() -> None:
    if _agent is not None:
        try:
            _agent.shutdown(timeout_s=_SHUTDOWN_TIMEOUT_S)
        except Exception:  # at exit, never turn a clean exit into a traceback
            log.exception("trainwarden: flush at exit failed")
