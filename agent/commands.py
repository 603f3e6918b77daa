"""Commands from the collector: a rollback to a checkpoint, a stop.

They ride back on the agent's own requests (the ingest answer lists the commands for
this rank), arrive on the exporter thread, and are applied on the training thread at
a step boundary: the hot path pays one attribute read while nothing is pending.

A rollback must happen at the same step on every rank, or the ranks' models diverge,
and as soon as possible: every step run after the anomaly is thrown away. It has two
phases, and the ranks *hold* in between:

1. **prepare**: each rank answers at once, from the exporter thread, with the last step
   it finished (``f``), and *holds* at its next step boundary (at most ``f + 1``; the
   training thread is never waited for, since it may sit in a collective with a rank
   that already holds).
2. The collector sends **commit** once every rank has answered, naming the barrier
   ``B = max(f) + 1``: no rank can be past it. A rank held before ``B`` trains on to
   ``B``; at ``B`` it calls the trainer's ``tw.on_rollback`` handler, so every rank
   restores the same checkpoint after the same step. In data-parallel lockstep the
   ranks' ``f`` differ by at most one, so the restore comes at most two steps after the
   command reached them. If a rank cannot answer, the collector sends **abort** (and
   tries again). A rank that cannot learn the decision within ``decision_timeout_s``
   goes on training and says so: a collector that fails between the two messages
   leaves the ranks in doubt; that is logged.

A **stop** command ends the process at a step boundary with :data:`STOPPED_EXIT_CODE`,
after flushing, so a launcher (torchrun elastic, Slurm requeue) restarts the job without
this rank's node. A stop of one node's ranks (an eviction) or of one rank is applied at
the next boundary. A stop of the whole run goes through the same two phases as a
rollback (``prepare`` / ``commit`` with the barrier, type ``stop``), so that every rank
stops after the same step: a rank that stopped one step before its peers would leave
them waiting in that step's collective until the group's timeout, where nothing tears
the job down on the first exit (Ray Train, ``mp.spawn``). A held rank that gets no
decision trains on, as for a rollback.

:class:`Commands` needs of the agent only :class:`CommandHost`: its events, its
exporter's wake-ups, its last step and its shutdown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

TWO_PHASE = ("rollback", "stop")
"""Command types that may come as a ``prepare`` then a ``commit`` (or ``abort``)."""
STOPPED_EXIT_CODE = 76
"""Exit status of a rank that trainwarden stopped (eviction of its node, or a stop)."""


@dataclass(frozen=True)
class RollbackPlan:
    """What a rollback asks of the trainer (``tw.on_rollback(handler)`` gets one)."""

    action: int
    checkpoint_step: int
    checkpoint_path: str
    skip_from: int
    """Skip the data batches with indices ``skip_from`` .. ``skip_to`` (inclusive):
    those consumed between the checkpoint and the anomaly, plus a margin. None when
    ``skip_to < skip_from`` (silent data corruption: the data was not the cause)."""
    skip_to: int
    lr_scale: float | None
    reason: str
    barrier_step: int
    """The last step run before the rollback, the same on every rank."""

    @classmethod
    def of(cls, prepare: dict[str, Any], commit: dict[str, Any]) -> RollbackPlan:
        """The plan of a prepare command, with the barrier (and the data window's end,
        known only then) from its commit."""
        p = prepare["plan"]
        return cls(
            action=int(prepare["action"]),
            checkpoint_step=int(p["checkpoint_step"]),
            checkpoint_path=str(p["checkpoint_path"]),
            skip_from=int(p["skip_from"]),
            skip_to=int(commit.get("skip_to", p["skip_to"])),
            lr_scale=p.get("lr_scale"),
            reason=str(p.get("reason", "")),
            barrier_step=int(commit["barrier_step"]),
        )


class CommandHost(Protocol):
    """What commands need of the agent."""

    @property
    def last_step(self) -> int | None:
        """The last step this rank finished."""

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None: ...

    def flush_soon(self) -> None:
        """Wake the exporter: an acknowledgement goes out now."""

    def poll_soon(self) -> None:
        """Ask the collector now (a heartbeat): its answer carries the decision."""

    def end_reason(self, reason: str, detail: str = "", exit_code: int | None = None) -> None: ...

    def shutdown(self, timeout_s: float = ...) -> None: ...


class Commands:
    def __init__(self, agent: CommandHost, *, decision_timeout_s: float = 60.0) -> None:
        self._agent = agent
        self.decision_timeout_s = decision_timeout_s
        self.pending = False  # read on the hot path: anything to do at the next boundary
        self._inbox: deque[dict[str, Any]] = deque()
        self._seen: set[int] = set()
        self._answered: set[int] = set()
        self._lock = threading.Lock()
        # (action, attempt) -> its commit or abort
        self._decisions: dict[tuple[int, Any], dict[str, Any]] = {}
        self._armed: dict[str, Any] | None = None
        self._handlers: list[Callable[[RollbackPlan], Any]] = []
        self._skip: list[tuple[int, int]] = []
        self.applied: list[RollbackPlan] = []
        # A ``collectives`` command (read the Flight Recorder) is answered here, on the
        # exporter thread: the training thread may be the one that is stuck.
        self.on_collectives: Callable[[dict[str, Any]], None] | None = None

    # -- the trainer's side --------------------------------------------------------------

    def on_rollback(self, handler: Callable[[RollbackPlan], Any]) -> None:
        self._handlers.append(handler)

    def off_rollback(self, handler: Callable[[RollbackPlan], Any]) -> None:
        """Forget ``handler`` (a framework callback whose training ended)."""
        if handler in self._handlers:
            self._handlers.remove(handler)

    def should_skip_batch(self, index: int) -> bool:
        return any(lo <= index <= hi for lo, hi in self._skip)

    # -- the exporter thread --------------------------------------------------------------

    def receive(self, commands: Any) -> None:
        """Commands from an ingest answer (repeated until acknowledged: new ones only)."""
        if not isinstance(commands, list):
            return
        asked = []
        with self._lock:
            for c in commands:
                if (
                    not isinstance(c, dict)
                    or not isinstance(c.get("id"), int)
                    or c["id"] in self._seen
                ):
                    continue
                self._seen.add(c["id"])
                if c.get("type") == "collectives":
                    asked.append(c)
                    continue
                if c.get("type") in TWO_PHASE and c.get("phase") in ("commit", "abort"):
                    self._decisions[_key(c)] = c
                self._inbox.append(c)
                self.pending = True  # before the step is read below: see _answer_prepare
        for c in commands:
            if isinstance(c, dict) and c.get("type") in TWO_PHASE and c.get("phase") == "prepare":
                self._answer_prepare(c)
        for c in asked:
            if self.on_collectives is None:
                self._ack(c, error="this agent cannot read its collectives")
                continue
            try:
                self.on_collectives(c)
            except Exception:  # the answer says why (flight.dump never raises): a bug here
                log.exception("trainwarden: answering collectives command %s failed", c["id"])

    def _answer_prepare(self, c: dict[str, Any]) -> None:
        """Answer a prepare at once, with the last step finished. ``pending`` was set
        first and the training thread writes its step before reading ``pending``, so the
        rank holds at most one step past the step it reports."""
        if c["id"] in self._answered:
            return
        self._answered.add(c["id"])
        if c.get("type") == "rollback" and not self._handlers:
            self._ack(c, armed=False, error="no tw.on_rollback(handler) in this trainer")
        else:
            self._ack(c, armed=True)  # the event's step: the last step finished

    # -- the training thread ----------------------------------------------------------------

    def at_boundary(self, finished: int) -> None:
        """Called after step ``finished`` ended, when something is pending."""
        superseded = True
        while superseded:  # a later prepare arrived while this rank held: hold for it
            with self._lock:
                inbox, self._inbox = list(self._inbox), deque()
            for c in inbox:
                try:
                    self._handle(c, finished)
                except SystemExit:
                    raise
                except Exception:
                    log.exception("trainwarden: command %s failed", c.get("id"))
            armed = self._armed
            superseded = armed is not None and self._decide(armed, finished)
        with self._lock:
            self.pending = bool(self._inbox) or self._armed is not None

    def _ack(self, c: dict[str, Any], **data: Any) -> None:
        self._agent.event(
            "command_ack",
            step=self._agent.last_step,
            command=c["id"],
            action=c.get("action"),
            phase=c.get("phase") or c.get("type"),
            **data,
        )
        self._agent.flush_soon()

    def _handle(self, c: dict[str, Any], finished: int) -> None:
        kind, phase = c.get("type"), c.get("phase")
        if kind == "stop" and phase is None:  # one node's ranks, or one rank: at once
            self._stop(c)
        elif kind in TWO_PHASE and phase == "prepare":
            # a later attempt of the same action replaces an earlier one
            if kind == "stop" or self._handlers:
                self._armed = c
        elif (
            kind in TWO_PHASE
            and phase == "commit"
            and (self._armed is None or _key(self._armed) != _key(c))
        ):
            if kind == "stop":  # its hold had timed out: the stop is still asked for
                self._stop(c, barrier_step=finished)
            else:
                self._ack(
                    c,
                    applied=False,
                    error="not holding for this rollback (its wait had timed out)",
                )

    def _decide(self, armed: dict[str, Any], finished: int) -> bool:
        """Hold here until the decision on ``armed`` is known; apply it once at its
        barrier. True when a later prepare of the same rollback ended the wait."""
        action, key = int(armed["action"]), _key(armed)
        if key not in self._decisions:
            started = time.monotonic()
            deadline = started + self.decision_timeout_s
            while key not in self._decisions and time.monotonic() < deadline:
                self._agent.poll_soon()  # ask the collector now: the answer carries the decision
                time.sleep(0.02)
                with self._lock:  # a later prepare of the same rollback supersedes this one
                    later = [
                        c
                        for c in self._inbox
                        if c.get("phase") == "prepare" and int(c.get("action", -1)) == action
                    ]
                if later:
                    self._armed = None
                    return True
        decision = self._decisions.get(key)
        reply = {
            "id": armed["id"],
            "action": action,
            "phase": (decision or {}).get("phase", "timeout"),
        }
        if decision is None or decision["phase"] != "commit":
            self._armed = None
            if decision is None:
                log.error(
                    "trainwarden: no decision on %s %s within %.0fs; training on",
                    armed.get("type"),
                    action,
                    self.decision_timeout_s,
                )
            self._ack(reply, applied=False, decision=reply["phase"], barrier_step=finished)
            return False
        barrier = int(decision["barrier_step"])
        if finished < barrier:
            return False  # held before the barrier: train on to it (still armed, still pending)
        self._armed = None
        if armed.get("type") == "stop":  # every rank ends after the same step (or now, if past)
            self._stop(armed, barrier_step=finished)
        if finished > barrier:  # it did not hold (it could not have, had it answered)
            self._ack(
                reply,
                applied=False,
                error=f"already past the barrier step {barrier} (at {finished})",
                barrier_step=finished,
            )
            return False
        plan = RollbackPlan.of(armed, decision)
        started = time.monotonic()
        try:
            for handler in self._handlers:
                handler(plan)
        except Exception as exc:
            log.exception("trainwarden: the rollback handler raised")
            self._ack(
                reply,
                applied=False,
                error=f"{type(exc).__name__}: {exc}"[:500],
                barrier_step=finished,
            )
            return False
        self._skip.append((plan.skip_from, plan.skip_to))
        self.applied.append(plan)
        self._ack(
            reply,
            applied=True,
            barrier_step=finished,
            checkpoint_step=plan.checkpoint_step,
            seconds=round(time.monotonic() - started, 3),
        )
        return False

    def _stop(self, c: dict[str, Any], **said: Any) -> None:
        reason = str(c.get("reason") or "stopped by trainwarden")
        log.warning("trainwarden: %s; exiting with status %d", reason, STOPPED_EXIT_CODE)
        self._ack({**c, "phase": "stop"}, stopped=True, reason=reason, **said)
        self._agent.event(
            "shutdown", reason=reason, exit_code=STOPPED_EXIT_CODE, severity="warning"
        )
        self._agent.end_reason("stopped", reason, STOPPED_EXIT_CODE)
        self._agent.shutdown(timeout_s=5.0)
        raise SystemExit(STOPPED_EXIT_CODE)


def _key(c: dict[str, Any]) -> tuple[int, Any]:
    """A two-phase action's decision belongs to one attempt (one barrier) of it."""
    return int(c["action"]), c.get("attempt")
