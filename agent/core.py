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
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

from . import flight, identity, last_words, node_relay, placement
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
    "SIGTERM_EXIT_CODE",
    "Step",
    "StepRecord",
    "current",
    "install_excepthook",
    "install_sigterm_flush",
    "set_current",
]

log = logging.getLogger(__name__)

AGENT_VERSION = "0.1.0"
_SHUTDOWN_TIMEOUT_S = 5.0
# Records wait (at most this long, in memory) behind the attempt_start event, so that the
# collector learns which attempt a process is before its first step.
_FIRST_EVENT_WAIT_S = 1.0
_IDENTITY_WAIT_AT_EXIT_S = 2.0
_PLACE_POLL_S = 0.05  # how often a process with no rank yet looks for its process group
_CHECKPOINT_SIZE_WAIT_AT_EXIT_S = 1.0
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # what a shell, Slurm or Kubernetes reports: 143


class Agent:
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

    def _make_drill(self) -> None:
        """The drill's faults for this rank: built once, from the rank as known when it is
        first needed (``tw.watch``, the first step, the GPU sampler); a process still
        without its rank takes the group's, else rank 0 of 1's, as it will report."""
        with self._place_lock:
            spec, self._drill_spec = self._drill_spec, None
            if spec is None:
                return
            c = self.config
            rank, world = c.rank, c.world_size
            if c.placement == "pending":
                group = placement.group_rank()
                if group is None:
                    alone = placement.without_group()
                    group = (alone.rank, alone.world_size)
                rank, world = group
            try:
                self.rare.use_drill(Drill(spec, rank=rank, world_size=world))
            except DrillError as exc:  # the group's world is smaller than the drill's rank
                log.warning("trainwarden: the drill is off: %s", exc)

    def _first_step(self) -> None:
        """The first step's entry (training thread): a drill acts from it on, and a process
        still without its rank settles it (a step without a process group: none will come)."""
        if self.config.placement != "pending":
            self._verify_place()  # before this step's record leaves under a wrong rank
        if self._drill_spec is not None:
            self._make_drill()
        self._settle.set()

    # -- run identity: the attempt_start event -------------------------------------------

    def _collect_identity(self) -> None:
        if self.config.placement == "pending":
            self._find_place()
        self._identity = identity.skeleton(self.config)
        try:
            identity.collect(self.config, self._identity, gpu_device=self.gpu_device)
        except Exception:  # never the trainer's problem: the fields stay None
            log.debug("trainwarden: identity collection failed", exc_info=True)
        self._start_attempt()
        self._check_place()

    # -- the process's place in the job (placement.py) ----------------------------------

    def _find_place(self) -> None:
        """Wait for the default process group, a step, the agent's shutdown or the
        deadline, whichever is first; take the place it gives; then connect."""
        c = self.config
        deadline = time.monotonic() + c.identity_wait_s
        place: placement.Place | None = None
        while place is None:
            group = placement.group_rank()
            if group is not None:
                place = placement.from_group(*group, host=c.host, run=c.run)
            elif self._settle.is_set() or time.monotonic() >= deadline:
                place = placement.without_group()
                if not self._settle.is_set():
                    log.warning(
                        "trainwarden: no RANK from the launcher and no process group after "
                        "%.0fs: reporting as rank %d of %d (TRAINWARDEN_IDENTITY_WAIT)",
                        c.identity_wait_s,
                        place.rank,
                        place.world_size,
                    )
            else:
                self._settle.wait(_PLACE_POLL_S)
        try:
            self._move_to(place)
            self._connect()
        finally:
            self._connected.set()

    def _move_to(self, place: placement.Place) -> None:
        self.config = dataclasses.replace(
            self.config,
            rank=place.rank,
            world_size=place.world_size,
            local_rank=place.local_rank,
            placement=place.source,
        )
        self.rare.use_config(self.config)

    def _check_place(self) -> None:
        """Rank from tw.init or the environment: once the process group exists (within
        the identity wait), the group's rank wins if they differ, with one warning."""
        c = self.config
        if c.placement not in ("argument", "environment"):
            return
        deadline = time.monotonic() + c.identity_wait_s
        while not self._closed and time.monotonic() < deadline:
            if self._verify_place():
                return
            if self._settle.is_set():  # steps without a group: not a distributed process
                return
            self._settle.wait(_PLACE_POLL_S)

    def _verify_place(self) -> bool:
        """Whether the process group exists; if it does and contradicts the rank said,
        move to the group's (once: from either thread). The local rank stays the
        launcher's (``LOCAL_RANK``) or the one said: no store exchange here."""
        group = placement.group_rank()
        if group is None:
            return False
        with self._place_lock:
            c = self.config
            if c.placement not in ("argument", "environment"):
                return True
            said = placement.Place(c.rank, c.world_size, c.local_rank, c.placement)
            warning = placement.differs(said, *group)
            if warning is None:
                return True
            local = placement.env_int("LOCAL_RANK")
            self._move_to(
                placement.Place(*group, c.local_rank if local is None else local, "process group")
            )
        log.warning(warning)
        self.event("rank_corrected", severity="warning", was=c.rank, message=warning)
        return True

    def _start_attempt(self) -> None:
        """Queue ``attempt_start`` (once), ahead of every record held back so far."""
        with self._attempt_lock:
            if self._attempt_started:
                return
            self._attempt_started = True
            # The identity thread may still be filling it, or not have begun (no rank yet).
            data = copy.deepcopy(self._identity or identity.skeleton(self.config))
        self.stats.recorded += 1
        record = EventRecord(self._event_body("attempt_start", None, "info", data, self.started_at))
        self._records.open_gate(record)
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

    def _wait_for_identity(self, timeout_s: float) -> None:
        thread = self._identity_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout_s))

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

    def shutdown(self, timeout_s: float = _SHUTDOWN_TIMEOUT_S) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing_thread = threading.current_thread()
        try:
            self._shutdown(timeout_s)
        finally:
            self._flushed.set()
        if self._sigterm_pending and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)  # die of it, now that the flush is done

    def _shutdown(self, timeout_s: float) -> None:
        started = time.monotonic()
        # The attempt ended when the trainer said so: not after the waits below (the
        # identity, the checkpoint sizes), which would add to its GPU-hours.
        ended_at = time.time()
        self._settle.set()  # a process still without its rank settles it now
        # ... on the identity thread, which then makes the exporter: wait for it (a busy
        # machine can keep that thread from running for a while), or the records it would
        # send are neither sent nor spooled.
        self._connected.wait(timeout_s / 2)
        if self._identity_thread is not None:
            # attempt_start goes out before the goodbye: with what is known by now.
            self._wait_for_identity(min(timeout_s / 2, _IDENTITY_WAIT_AT_EXIT_S))
            self._start_attempt()
        self._records.open_gate(None)
        self.checkpoints.finish(min(timeout_s / 4, _CHECKPOINT_SIZE_WAIT_AT_EXIT_S))
        # An exception that left a step and was never followed by a good step is how
        # this process ends: report it, so the collector marks the rank failed.
        last_step, last_error = self.recorder.last_step, self.recorder.last_error
        said: dict[str, Any] = {}
        if self.signalled_at is not None:
            said["signalled_at"] = self.signalled_at
        if last_error is not None:
            self.event("shutdown", step=last_step, severity="critical", error=last_error, **said)
        else:
            self.event("shutdown", step=last_step, **said)
        if self._identity_thread is not None:
            reason, detail, exit_code = self._end
            if reason == "completed" and last_error is not None:
                reason, detail = "exception", last_error  # it left a step, and ends us
            self.event_at(
                ended_at,
                "attempt_end",
                step=None,
                severity="info",
                data={
                    "reason": reason,
                    "detail": detail,
                    "exit_code": exit_code,
                    "last_step": last_step,
                },
            )
        if self.gpu_monitor is not None:
            self.gpu_monitor.stop()
        if self.crash_files is not None:  # a sibling died of a signal: said for it, now
            self.crash_files.report(wait_s=last_words.DYING_WAIT_S)
            self.crash_files.close()
        if self._exporter is not None:
            self._exporter.shutdown(max(0.1, timeout_s - (time.monotonic() - started)))
        if self._relay is not None:  # what it holds goes on; the node's others go direct
            self._relay.stop()


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
    worker's exit is not the rank's shutdown."""
    global _wakeup_fds
    if _wakeup_fds is not None:  # a child's signals are its own, not the rank's
        try:  # the forking thread is the child's main thread (CPython): allowed
            signal.set_wakeup_fd(-1)
        except ValueError:
            pass  # then the fd stays open: closed, its number could name another file
        else:
            for fd in _wakeup_fds:
                os.close(fd)
        _wakeup_fds = None
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
    _watch_for_sigterm()
    return True


# A Python signal handler runs on the main thread, between two bytecodes: never while that
# thread is inside a C call, such as a collective that waits for a peer that will never
# come (a hang, a desync). The launcher's SIGTERM then goes unanswered until its SIGKILL,
# and the job dies without a goodbye. So the C-level handler's wake-up byte
# (signal.set_wakeup_fd) is also read by a thread of the agent's: if the main thread has
# not begun its own flush within this grace, the agent's thread flushes for it.
_STUCK_GRACE_S = 1.0
_wakeup_fds: tuple[int, int] | None = None


def _watch_for_sigterm() -> None:
    """Read the signals' wake-up fd on a thread of its own (only where nobody else uses
    it: an asyncio loop in the trainer's main thread would, and keeps it)."""
    global _wakeup_fds
    if _wakeup_fds is not None:
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        previous = -2
    if previous != -1:  # someone else's (or not allowed): theirs stays
        if previous >= 0:
            signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    _wakeup_fds = (read_fd, write_fd)
    threading.Thread(
        target=_read_wakeups, args=(read_fd,), name="trainwarden-signals", daemon=True
    ).start()


def _read_wakeups(read_fd: int) -> None:
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data:
            _signalled()
            _flush_for_stuck_main_thread()


def _signalled() -> None:
    """Note when the first SIGTERM came (whichever of the two threads saw it first)."""
    agent = _agent
    if agent is not None and agent.signalled_at is None:
        agent.signalled_at = time.time()


def _flush_for_stuck_main_thread() -> None:
    agent = _agent
    deadline = time.monotonic() + _STUCK_GRACE_S
    while agent is not None and not agent._closed and time.monotonic() < deadline:
        time.sleep(0.05)
    if agent is None or agent._closed:
        return  # the main thread's handler took it (or the agent had already ended)
    log.warning(
        "trainwarden: SIGTERM while the training thread is inside a call (%s): flushing "
        "from the agent's thread",
        agent._phase_now() or "outside a step",
    )
    try:
        agent.event(
            "signal",
            step=agent.last_step,
            severity="warning",
            signal="SIGTERM",
            stuck_in=agent._phase_now(),
        )
        agent.end_reason("sigterm", "SIGTERM", SIGTERM_EXIT_CODE)
        agent.shutdown(timeout_s=_SHUTDOWN_TIMEOUT_S)
    except Exception:
        log.exception("trainwarden: flush on SIGTERM failed")


def _on_sigterm(signum: int, frame: Any) -> None:
    _signalled()
    agent = _agent
    if agent is not None and agent._closed and not agent._flushed.is_set():
        if agent._closing_thread is not threading.current_thread():
            # The agent's signal thread flushes (this thread was stuck in a call when
            # SIGTERM came): wait for it, then die of SIGTERM.
            agent._flushed.wait(_SHUTDOWN_TIMEOUT_S + 1.0)
        else:
            # The flush is under way on this thread (at exit after an exception, say: a
            # launcher stops the other ranks when one fails, often while this one is
            # flushing); this handler interrupted it. Let it finish (within its own
            # deadline), then die of SIGTERM.
            agent._sigterm_pending = True
            return
    if agent is not None and not agent._closed:
        log.warning(
            "trainwarden: SIGTERM; flushing (at most %.0fs) before exiting", _SHUTDOWN_TIMEOUT_S
        )
        try:
            agent.event("signal", step=agent.last_step, severity="warning", signal="SIGTERM")
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
