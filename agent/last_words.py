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
:func:`arm`, its last :data:`TAIL_BYTES`. A file other processes write to too (the parent
launcher's, a sibling rank's, any live process's fd 1 or 2) is not read: a message there
cannot be tied to this rank, and the event says to look in the rank's stderr instead.

Linux only (``/proc``); elsewhere :func:`arm` does nothing. Every failure is logged once
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
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .identity import attempt_key
from .sink import EventRecord
from .spool import default_spool_dir

log = logging.getLogger(__name__)

DIRNAME = "last-words"
KIND = "rank_crashed"
FAULT_BYTES = 64 * 1024
"""What is read of a fault file at most (faulthandler writes 100 frames a thread at most)."""
TAIL_BYTES = 64 * 1024
"""What is read of a rank's stderr at most: its end."""
STDERR_LINES = 20
"""The last lines of an own stderr file kept in the event (``stderr_tail``)."""
MAX_SESSIONS = 256
"""Sessions looked at in one scan at most (the newest)."""
MAX_FRAMES = 40
KEEP_S = 86_400.0
"""A reported session's files are deleted this long after it was reported."""
DYING_WAIT_S = 1.0
"""At shutdown, how long to wait for a sibling whose fault file is written but whose pid
has not yet gone (it is inside ``exit``)."""
PROC_SCAN = 8192
"""Processes looked at, at most, to tell whether a stderr file is shared."""

SIGNALS = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
"""faulthandler's names of the fatal signals it handles."""

_PROGRESS = struct.Struct("<qdqq")  # last step (-1: none), its end (wall), in a step, spare
_HEADER = re.compile(r"^Fatal Python error: (.+)$", re.M)
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')
_TERMINATE = re.compile(
    r"terminate called (?:after throwing an instance of '([^'\n]{0,200})'\n\s*what\(\):\s*"
    r"([^\n]{0,2000})|without an active exception|recursively)"
)
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


def pid_start(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state letter) of ``pid``; None: no such pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (OSError, ValueError):
        return None
    # The command name (field 2) may hold spaces and parentheses: fields follow the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return int(fields[19]), fields[0].decode()
    except (IndexError, ValueError):
        return None


def gone(pid: int, start: int | None) -> bool:
    """Whether the process that was ``pid`` (started at ``start``) no longer runs: no such
    pid, a zombie (dead, not yet reaped by its launcher), or another process under a
    reused pid."""
    now = pid_start(pid)
    if now is None:
        return True
    started, state = now
    return state in ("Z", "X", "x") or (start is not None and started != start)


def _same_file(path: str, dev: int, ino: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def stderr_facts() -> dict[str, Any]:
    """Where this process's fd 2 goes, as a later reader of it needs to know."""
    try:
        st = os.fstat(2)
    except OSError:
        return {"kind": "closed"}
    try:
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        path = None
    if stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISFIFO(st.st_mode):
        kind = "pipe"
    elif stat.S_ISCHR(st.st_mode):
        kind = "terminal" if os.isatty(2) else "device"
    elif stat.S_ISSOCK(st.st_mode):
        kind = "socket"
    else:
        kind = "other"
    facts: dict[str, Any] = {"kind": kind, "path": path}
    if kind == "file":
        ppid = os.getppid()
        facts.update(
            dev=st.st_dev,
            ino=st.st_ino,
            offset=st.st_size,  # only what is written from now on is this process's
            # The launcher (or the shell) writes to it too: ``torchrun ... 2> log``.
            parent_shares=any(
                _same_file(f"/proc/{ppid}/fd/{fd}", st.st_dev, st.st_ino) for fd in (1, 2)
            ),
        )
    return facts


def parse_fault(text: str, main_thread: int | None) -> dict[str, Any]:
    """A faulthandler dump: the signal and the main thread's stack (most recent first)."""
    header = _HEADER.search(text)
    fatal = header.group(1).strip() if header else None
    threads: list[tuple[bool, int, list[dict[str, Any]]]] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append((head.group(1) == "Current thread", int(head.group(2), 16), []))
            continue
        frame = _FRAME.match(line)
        if frame and threads and len(threads[-1][2]) < MAX_FRAMES:
            lineno = frame.group(2)
            threads[-1][2].append(
                {
                    "file": frame.group(1)[-300:],
                    "line": int(lineno) if lineno.isdigit() else None,
                    "function": frame.group(3)[:200],
                }
            )
    chosen = next((t for t in threads if t[1] == main_thread), None)
    chosen = chosen or next((t for t in threads if t[0] and t[2]), None)
    chosen = chosen or next((t for t in threads if t[2]), None)
    stack = chosen[2] if chosen else []
    return {
        "fatal": fatal,
        "signal": SIGNALS.get(fatal or ""),
        "stack": stack,
        "stack_thread": (
            None
            if chosen is None
            else "main"
            if chosen[1] == main_thread
            else "crashing"
            if chosen[0]
            else "other"
        ),
        "threads": len(threads),
        "collective": _collective(stack),
        "where": _where(stack),
    }


def _collective(stack: list[dict[str, Any]]) -> str | None:
    """The torch.distributed function the stack is in (innermost), e.g. ``all_reduce``."""
    for f in stack:
        if "/torch/distributed/" in f["file"] and f["function"] not in ("wrapper", "<module>"):
            return str(f["function"])
    return None


def _where(stack: list[dict[str, Any]]) -> str | None:
    """The trainer's own innermost frame: ``train.py:42 in main``."""
    for f in stack:
        if "/torch/" not in f["file"] and "/trainwarden/" not in f["file"]:
            return f"{os.path.basename(f['file'])}:{f['line']} in {f['function']}"
    return None


def parse_terminate(text: str) -> dict[str, Any] | None:
    """The last ``terminate called ...`` block libstdc++ wrote, if any."""
    found = None
    for found in _TERMINATE.finditer(text):  # noqa: B007 - the last one is wanted
        pass
    if found is None:
        return None
    exc_type, what = found.group(1), found.group(2)
    if exc_type is None:
        return {"type": None, "what": None, "cause": found.group(0).strip()}
    return {
        "type": exc_type,
        "what": what.strip(),
        "cause": f"C++ exception {exc_type}: {what.strip()}",
    }


def _shared_by_another(dev: int, ino: int, *, siblings: list[dict[str, Any]]) -> str | None:
    """Why a stderr file is not one rank's own, or None when nothing else writes to it."""
    for s in siblings:
        err = s.get("stderr") or {}
        if (err.get("dev"), err.get("ino")) == (dev, ino):
            return f"rank {s.get('rank')} (pid {s.get('pid')}) writes to it too"
    try:
        entries = os.scandir("/proc")
    except OSError:
        return None
    with entries:
        for n, entry in enumerate(entries):
            if n >= PROC_SCAN:
                break
            if not entry.name.isdigit():
                continue
            for fd in (1, 2):
                if _same_file(f"/proc/{entry.name}/fd/{fd}", dev, ino):
                    return f"process {entry.name} still writes to it"
    return None


def stderr_cause(who: dict[str, Any], siblings: list[dict[str, Any]]) -> dict[str, Any]:
    """The C++ message from a dead rank's stderr, or why it is not read."""
    err = who.get("stderr") or {}
    kind, path = err.get("kind"), err.get("path")
    if kind != "file":
        where = f"its stderr ({kind}{': ' + path if path else ''})"
        return {
            "cause": None,
            "cause_note": f"a C++ message, if any, went to {where}, which is not a file of "
            "this rank's own: see the launcher's output (run torchrun with --redirects 2 "
            "--log-dir DIR, or srun --error=%t.err, to keep it per rank)",
        }
    dev, ino, offset = int(err["dev"]), int(err["ino"]), int(err.get("offset") or 0)
    if err.get("parent_shares"):
        why: str | None = "its launcher writes to it too"
    elif not _same_file(str(path), dev, ino):
        why = "the file was moved or replaced since"
    else:
        why = _shared_by_another(dev, ino, siblings=siblings)
    if why:
        return {
            "cause": None,
            "cause_note": f"its stderr {path} is shared ({why}): a message there cannot be "
            "tied to this rank; see the rank's stderr",
        }
    try:
        with open(str(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(offset, size - TAIL_BYTES)
            f.seek(start)
            tail = f.read(TAIL_BYTES).decode("utf-8", "replace")
    except OSError as exc:
        return {"cause": None, "cause_note": f"its stderr {path} cannot be read: {exc}"}
    found = parse_terminate(tail)
    lines = [line for line in tail.splitlines() if line.strip()][-STDERR_LINES:]
    out: dict[str, Any] = {
        "stderr": path,
        "stderr_tail": "\n".join(lines)[-4096:],
        "cause": None,
        "cause_note": None,
    }
    if found is not None:
        out.update(cause=found["cause"][:2000], cxx_type=found["type"], cxx_what=found["what"])
    else:
        out["cause_note"] = f"no C++ terminate message in its stderr {path}"
    return out


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
