"""PyTorch's Flight Recorder, read live when a rank may be hung: which collectives it issued.

The recorder (``torch.distributed``, NCCL and gloo) keeps a ring of the collectives each
process issued: sequence id per process group, op, sizes, dtypes and state. When a job
hangs, every rank waits in some collective; lining the ranks' rings up by sequence id
names the rank that never arrived (the collector does that: ``collector/health``).

- :func:`enable` sets the recorder's size before the process group exists:
  ``TORCH_FR_BUFFER_SIZE`` (``flight_recorder_entries``, 2,000 entries by default; 0 sets
  it to 0, which turns the recorder off), never over a value the user set.
- :func:`dump` reads the ring through torch's API and keeps, per process group, the
  newest entries (:data:`KEEP_PER_GROUP`) in the ``collectives`` event's form. It never
  raises: a torch without the recorder, or a dump that fails, gives one unavailable
  answer saying why.
- :class:`Flight` decides when, on the **exporter thread** (the training thread is the one
  that is stuck): on the collector's ``collectives`` command, and once per stall when the
  training thread has not finished a step for the hung threshold.

The ``collectives`` event's data (what the collector validates, ``ingest/schema_events.py``)::

    {"trigger": "command" | "stalled", "request": <command id> | null,
     "available": true, "reason": null, "dumped_at": <unix s>,
     "groups": [{"pg": "0", "desc": "default_pg", "ranks": [0, 1, ...],
                 "last_enqueued": 4817, "last_completed": 4816, "dropped": 120,
                 "entries": [{"seq": 4817, "op": "all_reduce",
                              "in_sizes": [[1024]], "in_dtypes": ["Float"],
                              "out_sizes": [[1024]], "out_dtypes": ["Float"],
                              "state": "scheduled", "done": false,
                              "created": <unix s>, "started": null, "completed": null}]}]}

Entries are oldest first. ``done`` is whether the collective completed on this rank
(NCCL: its state; gloo, which records no start or completion times: retired).
Point-to-point operations have their own sequence and are left out.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

log = logging.getLogger(__name__)

ENV = "TORCH_FR_BUFFER_SIZE"
DEFAULT_ENTRIES = 2000
"""The recorder's ring size trainwarden asks for (the Flight Recorder tutorial's advice)."""
READERS = ("_dump_fr_trace_json", "_dump_nccl_trace_json")
"""torch's Flight Recorder dumps, as JSON: the generic one (gloo and others) and NCCL's."""
KEEP_PER_GROUP = 32
"""Entries sent per process group: the newest. A hang is decided by the last few."""
HUNG_MIN_S = 5.0
HUNG_STEPS = 5.0
"""The agent's own view of a stall: no step finished for max(HUNG_MIN_S, HUNG_STEPS x
its median step time), the collector's default hung threshold."""
MIN_STEP_TIMES = 3
"""Step times learnt (ticks a second apart that saw steps end) before a stall of this
rank's own is dumped: not in a run's first seconds, whose steps may be slow by design (a
first step that compiles; on a GPU, the profiler window's start took over 5 s)."""


def enable(entries: int) -> str | None:
    """Ask torch for a Flight Recorder ring of ``entries``; 0 turns it off (torch 2.13
    records gloo collectives with ``TORCH_FR_BUFFER_SIZE`` unset, so leaving the variable
    alone would not: only ``0`` does). Returns one line to log when it comes too late to
    be sure of, else None. A value the user set in ``TORCH_FR_BUFFER_SIZE`` wins."""
    if os.environ.get(ENV, "").strip():
        return None
    entries = max(0, entries)
    os.environ[ENV] = str(entries)
    dist = sys.modules.get("torch.distributed")
    try:
        late = dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:  # a torch in the middle of importing, or a broken one
        late = False
    if late:
        return (
            f"trainwarden: the process group existed before tw.init, so {ENV}={entries} may "
            "not apply to it (torch reads it when the group is made); call tw.init before "
            "torch.distributed.init_process_group for the Flight Recorder"
        )
    return None


def unavailable(reason: str, **fields: Any) -> dict[str, Any]:
    return {**fields, "available": False, "reason": reason, "dumped_at": time.time(), "groups": []}


def dump(*, trigger: str, request: int | None = None, keep: int = KEEP_PER_GROUP) -> dict[str, Any]:
    """This process's Flight Recorder ring, as a ``collectives`` event's data. Never raises."""
    head = {"trigger": trigger, "request": request}
    torch = sys.modules.get("torch")
    if torch is None:
        return unavailable("torch is not loaded in this process: no collectives to show", **head)
    c10d = getattr(getattr(torch, "_C", None), "_distributed_c10d", None)
    # NCCL's recorder is read by its own function where torch is built with NCCL (seen on
    # torch 2.11 + CUDA: _dump_fr_trace_json held no NCCL entries); gloo's by the generic.
    readers = [getattr(c10d, name, None) for name in READERS]
    if not any(readers):
        return unavailable(
            f"this torch ({getattr(torch, '__version__', '?')}) has no Flight Recorder "
            "(torch._C._distributed_c10d._dump_fr_trace_json; torch 2.5 or later has it)",
            **head,
        )
    raw: dict[str, Any] = {"entries": [], "pg_status": {}}
    failures = []
    for read in readers:
        if read is None:
            continue
        try:
            part = json.loads(read(True, False))
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            continue
        raw["entries"] += part.get("entries") or []
        raw["pg_status"].update(part.get("pg_status") or {})
    if failures and not raw["entries"]:
        return unavailable(f"the Flight Recorder dump failed: {'; '.join(failures)}", **head)
    try:
        ranks = group_ranks()
    except Exception:  # the mapping is a help, not a need: pg 0 is the world
        ranks = {}
    try:
        data = parse(raw, ranks=ranks, keep=keep)
    except Exception as exc:  # a dump of a form this version does not know
        return unavailable(
            f"the Flight Recorder dump has an unknown form: {type(exc).__name__}: {exc}", **head
        )
    if not data["groups"] and os.environ.get(ENV, "").strip() == "0":
        return unavailable(f"the Flight Recorder is off in this process ({ENV}=0)", **head)
    if not data["groups"] and not ranks:
        return unavailable("no process group in this process: no collectives to show", **head)
    return {**head, **data}


def group_ranks() -> dict[str, list[int]]:
    """The global ranks of each process group this process belongs to, by the group's name
    (what the recorder's entries call it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {}
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    return {
        str(world.pg_names[pg]): sorted(int(r) for r in ranks)
        for pg, ranks in world.pg_group_ranks.items()
        if pg in world.pg_names
    }


def _name(op: Any) -> str:
    """``gloo:all_reduce`` / ``nccl:all_reduce`` -> ``all_reduce``."""
    return str(op).rpartition(":")[2] or str(op)


def _seconds(ns: Any) -> float | None:
    return ns / 1e9 if isinstance(ns, (int, float)) and ns > 0 else None


def parse(raw: dict[str, Any], *, ranks: dict[str, list[int]], keep: int) -> dict[str, Any]:
    """A recorder dump (``_dump_fr_trace_json``) in the ``collectives`` event's form."""
    groups: dict[str, dict[str, Any]] = {}
    for e in raw.get("entries") or ():
        if e.get("is_p2p"):
            continue  # point-to-point ops have their own sequence: not lined up here
        pg = e.get("process_group") or [str(e.get("pg_id", "?")), ""]
        name = str(pg[0])
        group = groups.setdefault(
            name,
            {
                "pg": name,
                "desc": str(pg[1]) if len(pg) > 1 else "",
                "ranks": ranks.get(name, []),
                "entries": [],
                "seen": set(),
            },
        )
        state = str(e.get("state") or "")
        seq = int(e["collective_seq_id"])
        if seq in group["seen"]:
            continue  # the same collective in both dumps
        group["seen"].add(seq)
        group["entries"].append(
            {
                "seq": seq,
                "op": _name(e.get("profiling_name") or e.get("op_id")),
                "in_sizes": e.get("input_sizes") or [],
                "in_dtypes": e.get("input_dtypes") or [],
                "out_sizes": e.get("output_sizes") or [],
                "out_dtypes": e.get("output_dtypes") or [],
                "state": state,
                "done": state == "completed" or bool(e.get("retired")),
                "created": _seconds(e.get("time_created_ns")),
                "started": _seconds(e.get("time_discovered_started_ns")),
                "completed": _seconds(e.get("time_discovered_completed_ns")),
            }
        )
    status = raw.get("pg_status") or {}
    out = []
    for name, group in groups.items():
        del group["seen"]
        entries = sorted(group["entries"], key=lambda x: x["seq"])
        group["dropped"] = max(0, len(entries) - keep)
        group["entries"] = entries[-keep:] if keep > 0 else []
        for key in ("last_enqueued", "last_completed"):
            value = (status.get(name) or {}).get(f"{key}_collective")
            group[key] = int(value) if value is not None and int(value) >= 0 else None
        out.append(group)
    out.sort(key=lambda g: (len(g["pg"]), g["pg"]))
    return {"available": True, "reason": None, "dumped_at": time.time(), "groups": out}


class FlightHost(Protocol):
    """What :class:`Flight` needs of the agent (exporter thread only)."""

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None: ...

    def flush_soon(self) -> None: ...

    @property
    def last_step(self) -> int | None: ...


class Flight:
    """When to read the recorder: a command, or this rank's own stall (exporter thread).

    ``progress``: the training thread's last finished step and when it ended (wall
    clock), read without locking; ``(None, None)`` before the first. The typical step
    time is learnt from how far the step moved between ticks. ``entries`` 0: the
    recorder is not trainwarden's to read; a command is answered with why, a stall reads
    nothing."""

    def __init__(
        self,
        host: FlightHost,
        *,
        entries: int,
        progress: Callable[[], tuple[int | None, float | None]],
        reader: Callable[..., dict[str, Any]] = dump,
    ) -> None:
        self._host = host
        self.entries = entries
        self._progress = progress
        self._reader = reader
        self._seen: tuple[int, float] | None = None  # (step, its end) at an earlier tick
        self._step_s: deque[float] = deque(maxlen=16)
        self._stall_dumped: float | None = None  # the step end a stall dump was for
        self.dumps = 0

    def answer(self, command: dict[str, Any]) -> None:
        """The collector asks (a rank of the run is hung, or an operator asked)."""
        request = command.get("id") if isinstance(command.get("id"), int) else None
        if self.entries <= 0:
            data = unavailable(
                "the Flight Recorder is off in this trainer (flight_recorder_entries=0)",
                trigger="command",
                request=request,
            )
        else:
            data = self._reader(trigger="command", request=request)
        self._send(data)

    def step_time_s(self) -> float | None:
        """The median time a step took, as seen from the ticks (None: not known yet)."""
        return statistics.median(self._step_s) if self._step_s else None

    def tick(self, now: float | None = None) -> None:
        """Once per stall: the training thread has not finished a step for the hung threshold."""
        if self.entries <= 0:
            return
        step, ended = self._progress()
        if step is None or ended is None:
            return  # no step yet: a stall before the first is the collector's to ask about
        seen = self._seen
        if seen is not None and step > seen[0] and ended > seen[1]:
            self._step_s.append((ended - seen[1]) / (step - seen[0]))
        self._seen = (step, ended)
        if len(self._step_s) < MIN_STEP_TIMES:
            return  # warm-up (compiling, a profiler starting): the collector asks if it hangs
        now = time.time() if now is None else now
        threshold = max(HUNG_MIN_S, HUNG_STEPS * (self.step_time_s() or 0.0))
        if now - ended < threshold or self._stall_dumped == ended:
            return
        self._stall_dumped = ended
        data = self._reader(trigger="stalled")
        data["stalled_s"] = round(now - ended, 3)
        self._send(data)

    def _send(self, data: dict[str, Any]) -> None:
        self.dumps += 1
        severity = "warning" if data.get("available") else "info"
        self._host.event("collectives", step=self._host.last_step, severity=severity, **data)
        self._host.flush_soon()
