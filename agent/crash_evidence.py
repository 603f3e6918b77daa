"""Reading what a rank that died of a fatal signal left behind (:mod:`.last_words` writes
the files and reports the crash): whether its process is gone (``/proc``), where its stderr
went (:func:`stderr_facts`, recorded while it lives), the signal and main-thread stack of
its faulthandler dump (:func:`parse_fault`), and the C++ ``terminate`` message in its
stderr when that file is the rank's own (:func:`stderr_cause`).

Linux only (``/proc``); nothing here writes.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

TAIL_BYTES = 64 * 1024
"""What is read of a rank's stderr at most: its end."""
STDERR_LINES = 20
"""The last lines of an own stderr file kept in the event (``stderr_tail``)."""
MAX_FRAMES = 40
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

_HEADER = re.compile(r"^Fatal Python error: (.+)$", re.M)
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')
_TERMINATE = re.compile(
    r"terminate called (?:after throwing an instance of '([^'\n]{0,200})'\n\s*what\(\):\s*"
    r"([^\n]{0,2000})|without an active exception|recursively)"
)


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
