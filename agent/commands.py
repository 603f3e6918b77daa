"""Commands from the collector: a rollback to a checkpoint, a stop.

They ride back on the agent's own requests (the ingest answer lists the commands for
this rank), arrive on the exporter thread, and are applied on the training thread at
a step boundary: the hot path pays one attribute read while nothing is pending.

A rollback must happen at the same step on every rank, or the ranks' models diverge.
It has two phases:

1. **prepare** names a barrier step ``B``. A rank that has not finished ``B`` yet
   *arms* (and says so); a rank already past it refuses.
2. The collector sends **commit** only when every rank has armed, else **abort**. An
   armed rank that finishes step ``B`` waits there, polling the collector, until it
   learns which; on commit it calls the trainer's ``tw.on_rollback`` handler, so every
   rank restores the same checkpoint after the same step. (A rank that cannot learn
   the decision within ``decision_timeout_s`` goes on training and says so: it cannot
   have been committed without it, as commit needs every rank armed, but a collector
   that fails between the two messages leaves the ranks in doubt; that is logged.)

A **stop** command ends the process at the next step boundary with
:data:`STOPPED_EXIT_CODE`, after flushing, so a launcher (torchrun elastic, Slurm
requeue) restarts the job without this rank's node.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import Agent

log = logging.getLogger(__name__)

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
    those consumed between the checkpoint and the anomaly, plus a margin."""
    skip_to: int
    lr_scale: float | None
    reason: str
    barrier_step: int
    """The last step run before the rollback, the same on every rank."""

    @classmethod
    def of(cls, body: dict[str, Any]) -> RollbackPlan:
        p = body["plan"]
        return cls(action=int(body["action"]), checkpoint_step=int(p["checkpoint_step"]),
                   checkpoint_path=str(p["checkpoint_path"]), skip_from=int(p["skip_from"]),
                   skip_to=int(p["skip_to"]), lr_scale=p.get("lr_scale"), reason=str(p.get("reason", "")),
                   barrier_step=int(body["barrier_step"]))  # fmt: skip


class Commands:
    def __init__(self, agent: Agent, *, decision_timeout_s: float = 60.0) -> None:
        self._agent = agent
        self.decision_timeout_s = decision_timeout_s
        self.pending = False  # read on the hot path: anything to do at the next boundary
        self._inbox: deque[dict[str, Any]] = deque()
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self._decisions: dict[tuple[int, Any], str] = {}  # (action, attempt) -> commit | abort
        self._armed: dict[str, Any] | None = None
        self._handlers: list[Callable[[RollbackPlan], Any]] = []
        self._skip: list[tuple[int, int]] = []
        self.applied: list[RollbackPlan] = []

    # -- the trainer's side --------------------------------------------------------------

    def on_rollback(self, handler: Callable[[RollbackPlan], Any]) -> None:
        self._handlers.append(handler)

    def should_skip_batch(self, index: int) -> bool:
        return any(lo <= index <= hi for lo, hi in self._skip)

    # -- the exporter thread --------------------------------------------------------------

    def receive(self, commands: Any) -> None:
        """Commands from an ingest answer (repeated until acknowledged: new ones only)."""
        if not isinstance(commands, list):
            return
        with self._lock:
            for c in commands:
                if (
                    not isinstance(c, dict)
                    or not isinstance(c.get("id"), int)
                    or c["id"] in self._seen
                ):
                    continue
                self._seen.add(c["id"])
                if c.get("type") == "rollback" and c.get("phase") in ("commit", "abort"):
                    self._decisions[(int(c["action"]), c.get("attempt"))] = c["phase"]
                self._inbox.append(c)
                self.pending = True

    # -- the training thread ----------------------------------------------------------------

    def at_boundary(self, finished: int) -> None:
        """Called after step ``finished`` ended, when something is pending."""
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
        if armed is not None and finished >= armed["barrier_step"]:
            self._decide(armed, finished)
        with self._lock:
            self.pending = bool(self._inbox) or self._armed is not None

    def _ack(self, c: dict[str, Any], **data: Any) -> None:
        self._agent.event("command_ack", step=self._agent._last_step, command=c["id"],
                          action=c.get("action"), phase=c.get("phase") or c.get("type"), **data)  # fmt: skip
        self._agent.flush_soon()

    def _handle(self, c: dict[str, Any], finished: int) -> None:
        kind = c.get("type")
        if kind == "stop":
            self._stop(c)
        elif kind == "rollback" and c.get("phase") == "prepare":
            barrier = int(c["barrier_step"])
            if not self._handlers:
                self._ack(c, armed=False, error="no tw.on_rollback(handler) in this trainer")
            elif finished >= barrier:
                self._ack(
                    c, armed=False, error=f"already past the barrier step {barrier} (at {finished})"
                )
            else:  # a later attempt of the same rollback replaces an earlier one
                self._armed = c
                self._ack(c, armed=True)
        elif kind == "rollback" and (self._armed is None or _key(self._armed) != _key(c)):
            self._ack(
                c, applied=False, note="not armed for this action"
            )  # a decision it had no part in

    def _decide(self, armed: dict[str, Any], finished: int) -> None:
        action, key = int(armed["action"]), _key(armed)
        deadline = time.monotonic() + self.decision_timeout_s
        while key not in self._decisions and time.monotonic() < deadline:
            self._agent.poll_soon()  # ask the collector now: the answer carries the decision
            time.sleep(0.05)
            with self._lock:  # a later prepare of the same rollback supersedes this one
                later = [
                    c
                    for c in self._inbox
                    if c.get("phase") == "prepare" and int(c.get("action", -1)) == action
                ]
            if later:
                break
        self._armed = None
        decision = self._decisions.get(key)
        commit = {"id": armed["id"], "action": action, "phase": decision or "timeout"}
        if decision != "commit":
            if decision is None:
                log.error("trainwarden: no decision on rollback %s within %.0fs; training on",
                          action, self.decision_timeout_s)  # fmt: skip
            self._ack(commit, applied=False, decision=decision or "timeout", barrier_step=finished)
            return
        plan = RollbackPlan.of(armed)
        started = time.monotonic()
        try:
            for handler in self._handlers:
                handler(plan)
        except Exception as exc:
            log.exception("trainwarden: the rollback handler raised")
            self._ack(
                commit,
                applied=False,
                error=f"{type(exc).__name__}: {exc}"[:500],
                barrier_step=finished,
            )
            return
        self._skip.append((plan.skip_from, plan.skip_to))
        self.applied.append(plan)
        self._ack(commit, applied=True, barrier_step=finished, checkpoint_step=plan.checkpoint_step,
                  seconds=round(time.monotonic() - started, 3))  # fmt: skip

    def _stop(self, c: dict[str, Any]) -> None:
        reason = str(c.get("reason") or "stopped by trainwarden")
        log.warning("trainwarden: %s; exiting with status %d", reason, STOPPED_EXIT_CODE)
        self._ack(c, stopped=True, reason=reason)
        self._agent.event(
            "shutdown", reason=reason, exit_code=STOPPED_EXIT_CODE, severity="warning"
        )
        self._agent.shutdown(timeout_s=5.0)
        raise SystemExit(STOPPED_EXIT_CODE)


def _key(c: dict[str, Any]) -> tuple[int, Any]:
    """A rollback's decision belongs to one attempt (one barrier) of one action."""
    return int(c["action"]), c.get("attempt")
