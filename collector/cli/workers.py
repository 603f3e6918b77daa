"""``trainwarden serve --workers N``: N collector processes on one port.

One collector process is bound by its interpreter lock: its event loop (HTTP, parsing,
validation), writer, rollups, health and alerts share one core at a time. ``--workers``
forks N of them after the database is migrated once; each is a whole collector (its
own engine, writer and background loops) exactly as N ``trainwarden serve`` behind a
load balancer are (docs/scaling.md): the background work runs in one of them at a time
through PostgreSQL's advisory locks, and requests need no stickiness.

Each worker listens on the same address with ``SO_REUSEPORT``: the kernel spreads new
connections over the workers by a hash of their addresses, so relays' long-lived
connections are spread over the workers rather than left to whichever wakes first on one
shared socket (an asyncio server accepts a burst of connections at once). The parent
holds the port bound but not
listening, so that it stays this collector's while a worker restarts; it starts another
worker when one dies (a connection waiting in the dead one's queue is reset: agents and
relays send it again) and stops them all on SIGTERM or SIGINT.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("trainwarden.collector")

BACKLOG = 2048  # a worker's accept queue (uvicorn's default)
RESTART_PAUSE_S = 1.0  # a worker that dies is started again after this long
STOP_WAIT_S = 30.0  # how long the workers get to finish (their writers flush) on stop

Start = Callable[[socket.socket, Callable[[], None]], None]
"""Runs one worker's server on a listening socket until it is told to stop; calls its
second argument once it takes requests."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bound(host: str, port: int) -> socket.socket:
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when its parent dies (a collector killed with
    SIGKILL leaves no workers behind)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _worker(host: str, port: int, start: Start, ready_fd: int, parent: int) -> int:
    """The child's side: listen on the shared port and serve until stopped."""
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent, which stops the workers once
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before this worker could ask to follow it
        return 0
    try:
        sock = _bound(host, port)
        sock.listen(BACKLOG)

        def ready() -> None:
            with contextlib.suppress(OSError):  # a restarted worker's parent does not wait
                os.write(ready_fd, b"1")
                os.close(ready_fd)

        start(sock, ready)
        return 0
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def serve_workers(
    *,
    workers: int,
    host: str,
    port: int,
    start: Start,
    said: Callable[[str, int], None],
    gone: Callable[[int], None] = lambda _pid: None,
) -> None:
    """Run ``workers`` processes of ``start`` on ``host:port`` (0: a free port); ``said``
    is called once with the host and port when every worker takes requests, ``gone``
    with the pid of each worker that has exited."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("--workers needs SO_REUSEPORT (Linux, the BSDs, macOS)")
    holder = _bound(host, port)  # reserves the port; never listens, so gets no connection
    port = holder.getsockname()[1]
    children: dict[int, int] = {}  # pid -> worker number
    stopping = False

    def spawn(number: int) -> int:
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            holder.close()
            os._exit(_worker(host, port, start, write_fd, parent))
        os.close(write_fd)
        children[pid] = number
        return read_fd

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for pid in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        pipes = [spawn(number) for number in range(1, workers + 1)]
        for fd in pipes:  # each worker says it is ready, or closes its pipe dying
            with os.fdopen(fd, "rb") as pipe:
                if pipe.read(1) != b"1" and not stopping:
                    raise RuntimeError("a worker exited before it took requests (see above)")
        if not stopping:
            said(host, port)
        while children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            number = children.pop(pid, None)
            if number is None:
                continue
            gone(pid)
            if stopping:
                continue
            log.error(
                "trainwarden collector: worker %d (pid %d) exited (%s); starting another",
                number,
                pid,
                _exit_said(status),
            )
            time.sleep(RESTART_PAUSE_S)
            if not stopping:
                os.close(spawn(number))
    finally:
        stop(signal.SIGTERM, None)
        deadline = time.monotonic() + STOP_WAIT_S
        while children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                children.pop(pid, None)
            else:
                time.sleep(0.05)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        holder.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _exit_said(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.WEXITSTATUS(status)}"
