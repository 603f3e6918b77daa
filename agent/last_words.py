"""A rank's last words: what a process that dies of a fatal signal leaves on its node, and
how a surviving process of the node tells the collector on its behalf.

A rank aborted by C++ (gloo or NCCL throwing from a thread of their own: ``std::terminate``,
then SIGABRT) or killed by SIGSEGV, SIGBUS, SIGFPE or SIGILL runs no Python again: its
agent cannot send anything. So, once the process's identity is final (:func:`arm`), the
agent leaves three files in ``<spool>/<run>/last-words/rank-<rank>/`` (beside the ranks'
spool folders, whose every file is a batch), named by its session:

- ``<session>.json``: who it is (run, rank, session, pid and the pid's start time, host,
  boot id, attempt, collector URL, the main thread's id) and where its stderr goes;
- ``<session>.fault``: :func:`faulthandler.enable` writes the fatal signal and every
  thread's Python stack there, from its signal handler (C, no Python, no allocation);
  not when the trainer enabled faulthandler itself (it is the trainer's: left alone);
- ``<session>.progress``: 32 bytes mapped in memory, which the exporter thread rewrites
  at its ticks when the last step changed (no system call: a store into the page cache,
  which the kernel keeps when the process dies). The training thread does nothing more.

Whoever finds them: every agent, at its start (:func:`arm`: a restarted rank, the next
job of the run) and at its shutdown (a victim of the crash exits a few seconds later,
with "Connection reset by peer", through ``atexit`` or SIGTERM), looks at its run's
sibling sessions on this host: one whose process is gone (no such pid, a pid whose start
time differs: reused, or a zombie) and whose fault file is not empty died of a signal.
It queues one ``rank_crashed`` event on that rank's behalf (the event's ``rank``), with
the id ``rank_crashed:<session>``: two survivors sending it store it once.

The C++ message (``terminate called after throwing an instance of 'T'  what(): MSG``),
which libstdc++ writes to fd 2 before ``abort()``, is read after the death from the
rank's stderr when it is a regular file of that rank alone (torchrun ``--redirects 2
--log-dir``, ``--tee``; ``srun --error=%t.err``): only what was written there since
:func:`arm`, its last :data:`.crash_evidence.TAIL_BYTES`. A file other processes write
to too (the parent launcher's, a sibling rank's, any live process's fd 1 or 2) is not
read: a message there cannot be tied to this rank, and the event says to look in the
rank's stderr instead.

Reading those files (the dump, the stderr, ``/proc``) is :mod:`.crash_evidence`. Linux
only (``/proc``); elsewhere :func:`arm` does nothing. Every failure is logged once
and swallowed: nothing here may fail or slow the trainer.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import mmap
import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .crash_evidence import gone, parse_fault, pid_start, stderr_cause, stderr_facts
from .identity import attempt_key
from .sink import EventRecord
from .spool import default_spool_dir

log = logging.getLogger(__name__)

DIRNAME = "last-words"
KIND = "rank_crashed"
FAULT_BYTES = 64 * 1024
"""What is read of a fault file at most (faulthandler writes 100 frames a thread at most)."""
MAX_SESSIONS = 256
"""Sessions looked at in one scan at most (the newest)."""
KEEP_S = 86_400.0
"""A reported session's files are deleted this long after it was reported."""
DYING_WAIT_S = 1.0
"""At shutdown, how long to wait for a sibling whose fault file is written but whose pid
has not yet gone (it is inside ``exit``)."""

_PROGRESS = struct.Struct("<qdqq")  # last step (-1: none), its end (wall), in a step, spare
_SESSION = re.compile(r"^[0-9A-Za-z_-]{1,40}$")


class Host(Protocol):
    """What :func:`arm` needs of the agent."""

    config: Any
    session_id: str
    started_at: float
    recorder: Any
    _records: Any


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


@dataclass
class _Session:
    json: Path
    who: dict[str, Any]

    @property
    def stem(self) -> Path:
        return self.json.with_suffix("")


def _may_share(other: dict[str, Any], who: dict[str, Any]) -> bool:
    """Whether ``other`` may have written to ``who``'s stderr while ``who`` lived: any
    other session but an earlier one of the same rank, gone before ``who`` began (a
    restart appending to the same ``%t.err``)."""
    if other.get("session") == who.get("session"):
        return False
    earlier = (other.get("armed_at") or 0) < (who.get("armed_at") or 0)
    if other.get("rank") == who.get("rank") and earlier:
        return not gone(int(other.get("pid") or 0), other.get("pid_start"))
    return True


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(16_384))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _unlink(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


class LastWords:
    """One process's last-words files, and its reports of its siblings'."""

    def __init__(self, host: Host, root: str) -> None:
        c = host.config
        self._host = host
        self.run_dir = Path(root) / c.run
        self.directory = self.run_dir / DIRNAME / f"rank-{c.rank}"
        self.session = host.session_id
        self.faulthandler = "unavailable"
        self._fault: Any = None
        self._mm: mmap.mmap | None = None
        self._last: tuple[int, float, int] | None = None
        self._reported: set[str] = set()
        self._warned = False
        self._boot = _boot_id()

    # -- this process's own files -------------------------------------------------------

    def arm(self) -> None:
        host, c = self._host, self._host.config
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = self.directory / self.session
        if faulthandler.is_enabled():
            # The trainer's own (its file, its threads' choice): never taken from it.
            self.faulthandler = "trainer's"
            log.info(
                "trainwarden: faulthandler was enabled by the trainer; its dump goes where "
                "the trainer said, and a crash of this rank is not reported by trainwarden"
            )
        else:
            self._fault = open(f"{stem}.fault", "w")  # noqa: SIM115 - open for the process's life
            faulthandler.enable(file=self._fault, all_threads=True)
            self.faulthandler = "ours"
        fd = os.open(f"{stem}.progress", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, _PROGRESS.size)
            self._mm = mmap.mmap(fd, _PROGRESS.size)
        finally:
            os.close(fd)
        self.tick()
        pid = os.getpid()
        started = pid_start(pid)
        who = {
            "version": 1,
            "run": c.run,
            "rank": c.rank,
            "local_rank": c.local_rank,
            "world_size": c.world_size,
            "session": self.session,
            "pid": pid,
            "pid_start": started[0] if started else None,
            "boot_id": self._boot,
            "host": c.host,
            "hostname": socket.gethostname(),
            "node": c.node,
            "attempt": attempt_key()[0],
            "url": c.url,
            "started_at": host.started_at,
            "armed_at": time.time(),
            "main_thread": threading.main_thread().ident,
            "faulthandler": self.faulthandler,
            "stderr": stderr_facts(),
        }
        tmp = stem.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(who))
        tmp.replace(f"{stem}.json")  # whole or absent: a reader never sees half of it

    def tick(self) -> None:
        """The exporter thread, at each wake-up: the training thread's progress, into the
        mapped page when it changed (a store, no system call)."""
        mm = self._mm
        if mm is None:
            return
        try:
            rec = self._host.recorder
            last = rec.last_step
            now = (
                -1 if last is None else int(last),
                float(rec.last_step_wall or 0.0),
                1 if rec.current is not None else 0,
            )
            if now != self._last:
                _PROGRESS.pack_into(mm, 0, now[0], now[1], now[2], 0)
                self._last = now
        except Exception:
            self._warn("progress marker")

    def close(self) -> None:
        """At the agent's shutdown: siblings' crashes are reported first (:meth:`report`)."""
        mm, self._mm = self._mm, None
        if mm is not None:
            with contextlib.suppress(Exception):
                mm.close()

    # -- a sibling's -------------------------------------------------------------------

    def _sessions(self) -> list[_Session]:
        found: list[tuple[float, Path]] = []
        for rank_dir in (self.run_dir / DIRNAME).glob("rank-*"):
            for p in rank_dir.glob("*.json"):
                try:
                    found.append((p.stat().st_mtime, p))
                except OSError:
                    continue
        found.sort(reverse=True)
        out = []
        for _, p in found[:MAX_SESSIONS]:
            who = _read_json(p)
            if who is not None:
                out.append(_Session(p, who))
        return out

    def report(self, *, wait_s: float = 0.0) -> int:
        """Queue a ``rank_crashed`` event for each sibling session of this run on this host
        that died of a fatal signal and is not reported yet. ``wait_s``: how long to wait
        for one whose fault file is written but whose process is still exiting. Returns
        how many were queued. Never raises."""
        try:
            return self._report(wait_s)
        except Exception:
            self._warn("report of a crashed rank")
            return 0

    def _report(self, wait_s: float) -> int:
        sessions = self._sessions()
        mine = [s.who for s in sessions]
        deadline = time.monotonic() + wait_s
        queued = 0
        for s in sessions:
            who = s.who
            session = str(who.get("session") or "")
            if session == self.session or session in self._reported or not _SESSION.match(session):
                continue
            if who.get("boot_id") != self._boot or who.get("hostname") != socket.gethostname():
                continue  # another host's (a spool on a shared file system): not ours to judge
            fault = s.stem.with_suffix(".fault")
            try:
                written = fault.stat().st_size > 0
            except OSError:
                written = False
            pid, start = int(who.get("pid") or 0), who.get("pid_start")
            while written and not gone(pid, start) and time.monotonic() < deadline:
                time.sleep(0.05)  # a fault written: the process is in its exit
            if not gone(pid, start):
                continue  # alive: nothing to say
            reported = s.stem.with_suffix(".reported")
            if not written:  # it ended without a fatal signal: nothing to say
                _unlink(s.json, fault, s.stem.with_suffix(".progress"), reported)
                continue
            if reported.exists():
                if time.time() - reported.stat().st_mtime > KEEP_S:
                    _unlink(s.json, fault, s.stem.with_suffix(".progress"), reported)
                continue
            siblings = [w for w in mine if _may_share(w, who)]
            body = self.event(s, siblings)
            self._host._records.put(EventRecord(body))
            self._reported.add(session)
            queued += 1
            reported.write_text(json.dumps({"by": self.session, "at": time.time()}))
            log.warning(
                "trainwarden: rank %s (pid %s) died of %s; reported on its behalf",
                who.get("rank"),
                pid,
                body["data"].get("signal") or "a fatal signal",
            )
        return queued

    def event(self, s: _Session, siblings: list[dict[str, Any]]) -> dict[str, Any]:
        """The ``rank_crashed`` event of a dead session (its files ``s``)."""
        who = s.who
        fault = s.stem.with_suffix(".fault")
        with open(fault, "rb") as f:
            text = f.read(FAULT_BYTES).decode("utf-8", "replace")
        crashed_at = fault.stat().st_mtime
        parsed = parse_fault(text, who.get("main_thread"))
        last, last_end, in_step = None, None, False
        try:
            raw = s.stem.with_suffix(".progress").read_bytes()[: _PROGRESS.size]
            step, end, busy, _ = _PROGRESS.unpack(raw)
            last, last_end, in_step = (None if step < 0 else step), (end or None), bool(busy)
        except (OSError, struct.error):
            pass
        c = self._host.config
        data: dict[str, Any] = {
            **parsed,
            "session": who.get("session"),
            "pid": who.get("pid"),
            "host": who.get("host"),
            "node": who.get("node"),
            "attempt": who.get("attempt"),
            "crashed_at": crashed_at,
            "last_step": last,
            "last_step_end": last_end,
            "in_step": in_step,
            "fault": text[-8192:],
            "reported_by": {"rank": c.rank, "session": self.session, "pid": os.getpid()},
            **stderr_cause(who, siblings),
        }
        return {
            "id": f"{KIND}:{who['session']}",
            "kind": KIND,
            "ts": crashed_at,
            "step": last,  # the last step seen: the collector's step axis
            "severity": "critical",
            "rank": int(who["rank"]),
            "data": data,
        }

    def _warn(self, what: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("trainwarden: last words: %s failed", what, exc_info=True)


def _disable_in_child() -> None:
    """A forked child (a DataLoader worker) is not the rank: a crash of its own must not
    be written into the rank's fault file."""
    if _armed is not None and _armed.faulthandler == "ours":
        with contextlib.suppress(Exception):
            faulthandler.disable()


_armed: LastWords | None = None
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_disable_in_child)


def arm(host: Host) -> LastWords | None:
    """Leave this process's last-words files and report its siblings' crashes. Call once
    its identity (run, rank) is final; a second call returns the first's. None when it
    cannot be done here (no ``/proc``, no spool directory): logged once."""
    global _armed
    if _armed is not None and _armed.session == host.session_id:
        return _armed
    if _armed is not None:  # a new agent in this process (tw.init again): it takes over
        _armed.close()
        if _armed.faulthandler == "ours":
            faulthandler.disable()
        _armed = None
    c = host.config
    if not os.path.isdir("/proc/self"):
        return None
    if c.spool_dir is not None and c.spool_dir.strip().lower() in ("", "none", "off"):
        return None  # no disk for this run's agents: nothing left on it either
    try:
        words = LastWords(host, c.spool_dir or default_spool_dir())
        words.arm()
    except Exception as exc:
        log.warning("trainwarden: last words unavailable (%s): a crash is not reported", exc)
        return None
    _armed = words
    words.report()
    return words
