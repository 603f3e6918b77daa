"""How the process's end reaches its agent when the trainer does not call ``tw.shutdown``:
SIGTERM (a scheduler's preemption, a launcher stopping the job: flush within a deadline,
then die of the signal), also while the main thread is stuck inside a C call, and an
uncaught exception (the attempt's end reason). Installed by ``tw.init``; the ``atexit``
flush is :mod:`.core`'s, with the process's current agent.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from . import core
from .attempt import SHUTDOWN_TIMEOUT_S

log = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM  # what a shell, Slurm or Kubernetes reports: 143

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
    agent = core._agent
    if agent is not None and agent.signalled_at is None:
        agent.signalled_at = time.time()


def _flush_for_stuck_main_thread() -> None:
    agent = core._agent
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
        agent.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
    except Exception:
        log.exception("trainwarden: flush on SIGTERM failed")


def _on_sigterm(signum: int, frame: Any) -> None:
    _signalled()
    agent = core._agent
    if agent is not None and agent._closed and not agent._flushed.is_set():
        if agent._closing_thread is not threading.current_thread():
            # The agent's signal thread flushes (this thread was stuck in a call when
            # SIGTERM came): wait for it, then die of SIGTERM.
            agent._flushed.wait(SHUTDOWN_TIMEOUT_S + 1.0)
        else:
            # The flush is under way on this thread (at exit after an exception, say: a
            # launcher stops the other ranks when one fails, often while this one is
            # flushing); this handler interrupted it. Let it finish (within its own
            # deadline), then die of SIGTERM.
            agent._sigterm_pending = True
            return
    if agent is not None and not agent._closed:
        log.warning(
            "trainwarden: SIGTERM; flushing (at most %.0fs) before exiting", SHUTDOWN_TIMEOUT_S
        )
        try:
            agent.event("signal", step=agent.last_step, severity="warning", signal="SIGTERM")
            agent.end_reason("sigterm", "SIGTERM", SIGTERM_EXIT_CODE)
            agent.shutdown(timeout_s=SHUTDOWN_TIMEOUT_S)
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
    agent = core._agent
    # At an interactive prompt an exception does not end the process.
    if agent is not None and not agent._closed and not hasattr(sys, "ps1"):
        try:
            code = 128 + signal.SIGINT if issubclass(exc_type, KeyboardInterrupt) else 1
            agent.end_reason("exception", f"{exc_type.__name__}: {exc}", code)
        except Exception:
            pass
    (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def _forget_signals_in_child() -> None:
    """After ``fork`` (DataLoader workers): the rank's signal thread is not the child's."""
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


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_signals_in_child)
