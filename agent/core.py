"""The per-process agent: ``tw.init`` builds one :class:`Agent`, the module functions of
``trainwarden.agent`` delegate to it.

What it wires together:

- the training thread's hot path, ``tw.step`` (:mod:`.step`): clock reads and one
  ``deque.append``, no I/O and no device sync; the rare work (CUDA clock, sampling,
  drills) behind one comparison (:mod:`.rare`);
- the record queue (:mod:`.sink`), which holds records back until this process's
  ``attempt_start`` event is queued, and the exporter thread that drains it
  (:mod:`.exporter`, the spool of :mod:`.spool`, the transports); the counters
  (:class:`.stats.Stats`);
- run identity (gathered on a background thread), the GPU sampler and XID watcher
  (:mod:`.gpu`), checkpoint events (:mod:`.checkpoints`), the collector's commands
  (:mod:`.commands`), and the process's end: ``attempt_end`` from :meth:`Agent.shutdown`,
  at exit, on SIGTERM (flush, then die of it), on an uncaught exception; a forked child
  (a DataLoader worker) keeps records in memory and never reports.

``Agent`` is built here, with two mixins of its own methods: its rank settled
(:mod:`.rank_settling`) and its attempt started and ended (:mod:`.attempt`: the identity
thread, ``attempt_start``, the end reason, :meth:`Agent.shutdown`). This module also holds
the process's current agent (:func:`current`, :func:`set_current`), its ``atexit`` flush
and what a forked child forgets; the SIGTERM and uncaught-exception hooks are
:mod:`.exit_hooks`.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.util
import os
import threading
import time
import uuid
from typing import Any

from . import flight, last_words, node_relay
from .attempt import SHUTDOWN_TIMEOUT_S, AttemptLifecycle
from .checkpoints import Checkpointing, Checkpoints
from .commands import Commands
from .config import AgentConfig, ConfigError
from .datafeed import DataFeed
from .drills import Drill, DrillError, parse
from .encode import FlopModel, StepEncoder
from .exporter import Exporter, HttpTransport, Transport
from .flight import Flight
from .gpu import XID_SEVERITY, GpuMonitor, describe_xid, open_device
from .last_words import LastWords
from .mfu import Peak
from .rank_settling import RankSettling
from .rare import RareWork
from .samples import Universe
from .sink import EventRecord, GpuRecord, RecordQueue
from .spikes import SpikeDetector
from .spool import DiskSpool, MemorySpool, Spool, default_spool_dir
from .stats import Stats
from .step import Recorder, Step, StepRecord

# Step, StepRecord, EventRecord and GpuRecord lived here; they stay importable from here.
__all__ = [
    "AGENT_VERSION",
    "Agent",
    "EventRecord",
    "GpuRecord",
    "Step",
    "StepRecord",
    "current",
    "set_current",
]

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
# Records wait (at most this long, in memory) behind the attempt_start event, so that the
# collector learns which attempt a process is before its first step.
_FIRST_EVENT_WAIT_S = 1.0


class Agent(RankSettling, AttemptLifecycle):
    """One per process. Created by ``tw.init``; the module functions delegate to it."""

    crash_files: LastWords | None = None  # this rank's last words, once its rank is final

    def __init__(self, config: AgentConfig, *, transport: Transport | None = None) -> None:
        self.config = config
        self.session_id = uuid.uuid4().hex
        self.started_at = time.time()
        self.stats = Stats()
        self.spikes = SpikeDetector()  # exporter thread: flags on every step
        self.flop_model = FlopModel()
        if config.flops_per_step is not None:
            self.flop_model = FlopModel(
                per_step=config.flops_per_step, source="given: flops_per_step"
            )
        elif config.flops_per_token is not None:
            self.flop_model = FlopModel(
                per_token=config.flops_per_token, source="given: flops_per_token"
            )
        self._encode = StepEncoder(spikes=self.spikes, flop_model=self.flop_model, peak=None)
        self._records = RecordQueue(
            size=config.queue_size, batch_size=config.batch_size, stats=self.stats
        )
        self.commands = Commands(self)
        # Before the process group exists (tw.init's place in the trainer): see flight.py.
        late = flight.enable(config.flight_recorder_entries)
        if late:
            log.warning(late)
        self.flight = Flight(
            self,
            entries=config.flight_recorder_entries,
            progress=lambda: (self.recorder.last_step, self.recorder.last_step_wall),
        )
        self.commands.on_collectives = self.flight.answer
        # What a step touches (step.py); the rare work keeps its flag (rare.py).
        self.recorder = Recorder(self._records.put, self.commands)
        # Epochs and a watched loader's ids (datafeed.py); the exporter reads its sample.
        self.recorder.data = DataFeed(self._epoch_end)
        if config.dataset_size is not None:
            self.recorder.data.universe = Universe(config.dataset_size)
        self._encode.data = self.recorder.data
        self.skip_spikes = self.recorder.skip_spikes  # training thread: s.should_skip_step()
        self.rare = RareWork(self.recorder, config=config, encoder=self._encode, drill_host=self)
        self.checkpoints = Checkpoints(self)
        self._exporter: Exporter | None = None
        self._relay: Any = None  # the node's relay, when this agent runs it (relay="auto")
        if transport is None and config.url is not None and config.exporter == "otlp":
            # Only when asked for: it builds on opentelemetry-sdk, an optional extra.
            from .otlp import OtlpTransport

            transport = OtlpTransport(
                config.url, token=config.token, timeout_s=config.request_timeout_s
            )
        self._transport = transport  # else an HTTP one, made once the rank is known
        self._closed = False
        self._flushed = threading.Event()  # set once shutdown() has sent what it could
        self._sigterm_pending = False  # a SIGTERM came during shutdown(): die of it after
        # When a SIGTERM reached this process (wall clock), said in the goodbye: a rank its
        # teardown stalled (a peer that left first) was not hung when the job was stopped.
        self.signalled_at: float | None = None
        self._closing_thread: threading.Thread | None = None  # the one that runs shutdown()
        self._identity_thread: threading.Thread | None = None
        self._identity: dict[str, Any] = {}
        self._attempt_started = False
        self._attempt_lock = threading.Lock()
        self._end: tuple[str, str, int | None] = ("completed", "", None)
        self.gpu_device: Any = None
        self.gpu_monitor: GpuMonitor | None = None
        self._drill_spec = None
        self._place_lock = threading.Lock()
        if config.drill:
            try:
                self._drill_spec = parse(config.drill)
                if config.placement != "pending":  # else checked against the group's world
                    Drill(self._drill_spec, rank=config.rank, world_size=config.world_size)
            except DrillError as exc:
                raise ConfigError(str(exc)) from None
        # Until the process knows its rank nothing goes out: records wait behind the gate
        # (bounded) and no exporter runs (placement.py). The first step settles it.
        self._settle = threading.Event()  # a step ran, or the agent is shutting down
        self._connected = threading.Event()  # the rank is final and the exporter made
        if transport is None and config.url is None:
            log.warning(
                "trainwarden: no collector URL (tw.init(url=...) or TRAINWARDEN_URL); "
                "keeping the last %d records in memory only",
                config.queue_size,
            )
        if config.placement == "pending":
            if transport is not None or config.url is not None:
                self._records.connect(self.flush_soon, hold_s=config.identity_wait_s + 5.0)
        else:
            self._connect()
            self._connected.set()
        self.rare.on_first_step = self._first_step
        self.rare.schedule()
        self._identity_thread = threading.Thread(
            target=self._collect_identity, name="trainwarden-identity", daemon=True
        )
        self._identity_thread.start()

    def _connect(self) -> None:
        """What needs the process's rank: the exporter (and its spool and relay), the GPU
        sampler, the drill; then the ``start`` event. Once, when the rank is known."""
        config = self.config
        transport = self._transport
        if transport is None and config.url is not None:
            relays: list[str] | None = None
            job: str | None = None
            if config.relay == "auto":
                self._relay = node_relay.start(config)
                relays, job = node_relay.urls(config), node_relay.job_key(config.run)
            elif config.relay is not None:
                relays = [config.relay]
            transport = HttpTransport(
                config.url,
                token=config.token,
                timeout_s=config.request_timeout_s,
                relays=relays,
                job=job,
            )
        if transport is not None:
            self._exporter = Exporter(
                queue=self._records.queue,
                header=self._header,
                encode=self._encode,
                transport=transport,
                run=config.run,
                batch_size=config.batch_size,
                interval_s=config.flush_interval_s,
                heartbeat_s=config.heartbeat_s,
                stats=self.stats,
                on_commands=self.commands.receive,
                on_tick=self._tick,
                spool=self._open_spool(),
                # With a relay, the node's ranks send together: it merges them.
                phase_of=None if config.relay is None else node_relay.group(config),
            )
            # Until attempt_start is queued, records are held back (sink.py).
            self._records.connect(self._exporter.wake, hold_s=_FIRST_EVENT_WAIT_S)
        self.event_at(
            self.started_at,
            "start",
            step=None,
            severity="info",
            data={
                "pid": os.getpid(),
                "world_size": config.world_size,
                "rank_from": config.placement,
            },
        )
        self._start_gpu_monitor(simulate=bool(self.drill and self.drill.needs_gpu))
        # Opening NVML can take a while: the wait for attempt_start counts from here.
        self._records.hold(_FIRST_EVENT_WAIT_S)
        # Now that the rank is final: files a crash leaves, a sibling's crash reported.
        self.crash_files = last_words.arm(self)

    def _tick(self) -> None:
        """The exporter thread, at each wake-up."""
        self.flight.tick()
        if self.crash_files is not None:
            self.crash_files.tick()

    # -- what the training thread last did (the heartbeat and the events say it) ----------

    @property
    def last_step(self) -> int | None:
        """The last step this process finished."""
        return self.recorder.last_step

    @property
    def peak(self) -> Peak | None:
        """The peak FLOP/s that MFU divides by (None until known)."""
        return self._encode.peak

    @property
    def drill(self) -> Drill | None:
        """The fault drill in effect (``tw.init(drill=...)``), if any."""
        if self._drill_spec is not None:
            self._make_drill()
        return self.rare.drill

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
            on_sample=lambda sample: self._records.put(GpuRecord(sample)),
            on_xid=self._on_xid,
        )
        self.gpu_monitor.start()

    def _on_xid(self, code: int) -> None:
        info = describe_xid(code)
        device = self.gpu_device
        self.event(
            "xid",
            step=self.last_step,
            severity=XID_SEVERITY.get(info["action"], "warning"),
            code=code,
            gpu_uuid=getattr(device, "uuid", None),
            host=self.config.host,
            node=self.config.node,
            simulated=getattr(device, "simulated", False),
            **info,
        )
        self.flush_soon()

    # -- the exporter -------------------------------------------------------------

    def flush_soon(self) -> None:
        if self._exporter is not None:
            self._exporter.wake()

    def poll_soon(self) -> None:
        """Ask the collector for commands now (a heartbeat, if nothing else is queued)."""
        if self._exporter is not None:
            self._exporter.poll_soon()

    def flush(self, timeout_s: float) -> None:
        """Send what is queued now, waiting at most ``timeout_s`` (the exporter thread says
        when it is done: no polling)."""
        if self._records.gated:
            self._wait_for_identity(min(timeout_s / 2, _FIRST_EVENT_WAIT_S))
            self._records.open_gate(None)
        if self._exporter is not None:
            self._exporter.flush(timeout_s)

    def _header(self) -> dict[str, Any]:
        c = self.config
        recorder = self.recorder
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
            "last_step": recorder.last_step,
            "last_step_end": recorder.last_step_wall,
            "in_step": recorder.current is not None,
            "phase": self._phase_now(),
        }

    def _phase_now(self) -> str | None:
        record = self.recorder.current
        if record is None:
            return None
        phases = record.phases
        return phases[-1][0] if phases else "step"

    # -- what the trainer calls -------------------------------------------------------

    def count_flops_on_next_step(self) -> None:
        """Count the next step's FLOPs with ``FlopCounterMode`` (``tw.watch``)."""
        self.rare.count_flops_on_next_step()

    def step(self, step: int, tokens: Any = None) -> Step:
        return Step(self.recorder, step, tokens)

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None:
        """Queue an event (restart, shutdown, ...). Cheap; safe from any thread."""
        self._records.put(EventRecord(self._event_body(kind, step, severity, data, None)))

    def event_at(
        self, ts: float, kind: str, *, step: int | None, severity: str, data: dict[str, Any]
    ) -> None:
        """An event of an earlier moment ``ts`` (wall clock), queued now."""
        self._records.put(EventRecord(self._event_body(kind, step, severity, data, ts)))

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

    def _epoch_end(self, epoch: int, last_step: int, facts: dict[str, Any]) -> None:
        self.event("epoch_end", step=last_step, epoch=epoch, last_step=last_step, **facts)

    def end_epoch(self) -> None:
        self.recorder.data.end()

    def use_dataset_size(self, size: int) -> None:
        """A watched loader's dataset length, unless ``dataset_size`` was given."""
        if self.recorder.data.universe is None:
            self.recorder.data.universe = Universe(size)

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
        self.checkpoints.saved(
            step, path, seconds=seconds, bytes=bytes, drain_seconds=drain_seconds, meta=meta
        )

    def checkpointing(self, step: int, path: Any = None) -> Checkpointing:
        return self.checkpoints.timing(step, path)

    def checkpoint_drained(self, step: int, seconds: float, path: Any = None) -> None:
        self.checkpoints.drained(step, seconds, path)

    def recent(self, n: int = 100) -> list[Any]:
        """The last ``n`` records kept locally (only when there is no collector)."""
        return self._records.recent(n)


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
        if multiprocessing.parent_process() is not None:
            # A rank started by torch.multiprocessing.spawn or Accelerate's notebook
            # launcher: such a child leaves through os._exit, which skips atexit, after
            # running multiprocessing's own finalizers.
            multiprocessing.util.Finalize(None, _flush_at_exit, exitpriority=100)
        _atexit_registered = True
    _agent = agent


def _forget_in_child() -> None:
    """After ``fork`` (DataLoader workers): the child has none of the agent's threads and
    is not the rank; its agent keeps records in memory only and never reports, so a
    worker's exit is not the rank's shutdown (its signals: :mod:`.exit_hooks`)."""
    if _agent is not None:
        _agent._exporter = None
        _agent.gpu_monitor = None
        _agent._closed = True
        _agent._flushed = threading.Event()  # the parent's may be held by one of its threads
        _agent._flushed.set()  # nothing to flush here: a SIGTERM kills the child at once
        _agent._records.forget_exporter()
        # CUDA cannot be used in a child forked after it was initialized: no GPU clock.
        _agent.rare.forget_cuda()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _flush_at_exit() -> None:
    if _agent is not None:
        try:
            _agent.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
        except Exception:  # at exit, never turn a clean exit into a traceback
            log.exception("trainwarden: flush at exit failed")
