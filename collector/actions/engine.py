"""Acting on alerts: roll a run back to a good checkpoint, evict a node, stop a run.

Each action is a row of ``actions`` with a state machine and its history::

    proposed -> approved -> executing -> done
        \\           \\            \\-> failed
         \\-> cancelled  \\-> cancelled / failed

- **Triggers**: a firing alert whose rule has ``action: rollback | evict | stop`` (one
  action per alert episode and kind: idempotent by fingerprint), or an operator
  (``POST /api/v1/runs/{run}/actions``).
- **Policy** per kind (``serve --actions FILE``): ``auto`` (approved at once),
  ``require-ack`` (approved when its alert is acknowledged, or through
  ``POST /api/v1/actions/{id}/approve``), ``dry-run`` (the plan is made and recorded,
  nothing is done: the default). Rollbacks have a budget (at most N per period; past
  it the run is stopped and paged instead); evictions a blast-radius guard (at most a
  fraction of the run's nodes per hour) and a cool-down.
- **Rollback** (see ``agent/commands.py`` for the rank's side): the newest *clean*
  checkpoint and the data window to skip. The onset is where the anomaly began in the
  data (``alerts.onset_step``: the first step of the rule's streak, or the event's own
  step), not when a pass noticed it. The loss of step k is computed with the weights
  after update k - 1, so a checkpoint saved after step s is clean for an onset at k iff
  s <= k - 2 (:func:`clean_limit`), less ``margin_steps``.
  Commands ride back on the agents' ingest answers: *prepare* (every live rank answers
  with its step and holds at its next step boundary), then *commit* naming the barrier
  step (one past the newest step answered) once every rank has answered, else *abort*
  and another attempt. Once every rank restored, the rollback checks its own result
  (``collector/actions/rollback_check.py``): the alert's rule over the first steps run again.
  Still holding, the checkpoint was bad too: the rollback goes again to the next older
  clean checkpoint (within the budget), or fails and pages. Only then is it ``done``.
- **Stop**: every rank ends after the same step, with ``STOPPED_EXIT_CODE``; an attempt
  the same launch begins after a done stop of the run (a launcher's restart) is stopped
  too (``collector/actions/stop_restarts.py``).
- **Evict**: the node goes through the scheduler backend (``collector/actions/evict/``:
  Slurm, Kubernetes, a command), then the node's ranks get a *stop* command and exit
  with ``STOPPED_EXIT_CODE`` so the launcher restarts the job without them.

Every state change is also an event of the run (kind ``action``), for the timeline; a
failed action is an ``action_failed`` event, which the ActionFailed rule pages.
One collector runs the engine at a time (an advisory lock), as for alerts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sqlalchemy import Engine, func, or_, select, update

from trainwarden.alerts.rules import Rule, action_kinds
from trainwarden.collector.actions.commands import CommandBoard
from trainwarden.collector.actions.evict import load_backend
from trainwarden.collector.actions.evict_transitions import EvictTransitions
from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.records import (
    ACTIVE,
    create_action,
    store_events,
)
from trainwarden.collector.actions.resumes import suspect_resumes
from trainwarden.collector.actions.rollback_transitions import RollbackTransitions
from trainwarden.collector.actions.stop_restarts import stop_restarts
from trainwarden.collector.actions.transitions import Ctx
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import RollbackPlan
from trainwarden.collector.store.db import leads, write

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_6163_7473  # "twacts"


# -- the engine ---------------------------------------------------------------------------


class ActionEngine(RollbackTransitions, EvictTransitions):
    def __init__(
        self,
        engine: Engine,
        policy: ActionPolicy,
        *,
        board: CommandBoard | None = None,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        backend: Any = None,
        rules: Sequence[Rule] = (),
    ) -> None:
        self.engine = engine
        self.policy = policy
        self.rules = {r.name: r for r in rules}  # to check a rollback's result
        self.board = board or CommandBoard()
        self.interval_s = interval_s
        self.clock = clock
        self.backend = backend
        if self.backend is None and policy.evict.backend is not None:
            self.backend = load_backend(policy.evict.backend)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainwarden-evict")
        self._evictions: dict[int, Future[Any]] = {}
        self._resumes_checked: set[int] = set()  # restarts looked at (resumes.py)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- thread ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainwarden-actions", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception:
                log.exception("action engine failed; retrying")

    # -- one pass ---------------------------------------------------------------------

    def run_once(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with write(self.engine) as conn:
            if not leads(conn, ADVISORY_LOCK_KEY):
                self.board.refresh(conn)
                return
            ctx = Ctx(conn, now)
            ctx.events += suspect_resumes(
                conn,
                now=now,
                margin_steps=self.policy.rollback.margin_steps,
                checked=self._resumes_checked,
            )
            stop_restarts(conn, self.policy, now=now)
            self._triggers(ctx)
            for row in conn.execute(
                select(m.actions).where(m.actions.c.state.in_(ACTIVE)).order_by(m.actions.c.id)
            ).all():
                try:
                    self._advance(ctx, row)
                except Exception as exc:
                    log.exception("action %s failed", row.id)
                    self._finish(
                        ctx, row, "failed", reason=f"internal error: {type(exc).__name__}: {exc}"
                    )
            store_events(conn, ctx.events, now)
            self._close_commands(ctx)
            self.board.refresh(conn)
        # Only once the action is on record as executing: a pass whose transaction failed
        # leaves it approved, and must not have started the backend (it would run twice).
        timeout = self.policy.evict.timeout.value
        for action_id, eviction in ctx.evictions:
            self._evictions[action_id] = self._pool.submit(
                self.backend.evict, eviction, timeout_s=timeout
            )

    def _close_commands(self, ctx: Ctx) -> None:
        """Stop sending the commands of finished actions once the ranks have had time to
        take them (the abort of a failed rollback goes out after the action ended)."""
        c = m.agent_commands.c
        finished = select(m.actions.c.id).where(m.actions.c.state.not_in(ACTIVE))
        ctx.conn.execute(
            update(m.agent_commands)
            .where(
                c.done_at.is_(None),
                c.created_at < ctx.now - self.policy.rollback.prepare_timeout.value,
                c.action_id.in_(finished),
            )
            .values(done_at=ctx.now)
        )

    # -- creating actions -------------------------------------------------------------------

    def _triggers(self, ctx: Ctx) -> None:
        a = m.alerts.c
        firing = ctx.conn.execute(
            select(m.alerts).where(a.state == "firing", a.action != "none", a.silenced_by.is_(None))
        ).all()
        for alert in firing:
            key = f"{alert.fingerprint}:{alert.id}"  # one action per episode of the alert
            evicting: int | None = None  # evict+rollback: the rollback waits for it
            for kind in action_kinds(alert.action):
                seen = ctx.conn.execute(
                    select(m.actions.c.id).where(
                        m.actions.c.fingerprint == key, m.actions.c.kind == kind
                    )
                ).scalar()
                covering = seen if seen is not None else self._covering(ctx, alert, kind)
                if covering is not None:
                    evicting = covering if kind == "evict" else evicting
                    continue
                made = create_action(
                    ctx.conn,
                    self.policy,
                    run_id=alert.run_id,
                    kind=kind,
                    now=ctx.now,
                    trigger=f"rule:{alert.rule}",
                    alert_id=alert.id,
                    fingerprint=key,
                    rank=alert.rank,
                    node=alert.node,
                    detail=(alert.annotations or {}).get("description"),
                    plan=(
                        RollbackPlan(after_evict=evicting)
                        if kind == "rollback" and evicting
                        else None
                    ),
                )
                evicting = made if kind == "evict" else evicting

    def _covering(self, ctx: Ctx, alert: Any, kind: str) -> int | None:
        """The action of the run (for an eviction: of the node) that already answers this
        alert, if any: one rollback for a spike that every rank flags, one eviction per
        node. A dry run stands only for dry runs: it never holds back a real action, and it
        records one plan where the real thing would act once, not one per rank."""
        a = m.actions.c
        dry = a.mode == "dry-run" if self.policy.of(kind).mode == "dry-run" else a.mode != "dry-run"
        # One that ended answers alerts of the same episode (the ranks' alerts of one spike
        # fire within a minute), but not an alert that began after a restart that came
        # after it: it acted on processes that are gone (a restart may load what a
        # rollback undid: resumes.py).
        restarted = ctx.conn.execute(
            select(func.max(m.attempts.c.started_at)).where(m.attempts.c.run_id == alert.run_id)
        ).scalar()
        ended = a.created_at >= alert.active_since - 60
        if restarted is not None and alert.active_since >= restarted:
            ended = ended & (a.created_at >= restarted)
        query = select(a.id).where(
            a.run_id == alert.run_id,
            a.kind == kind,
            dry,
            or_(a.state.in_(ACTIVE), ended),
        )
        if kind == "evict":
            query = query.where(a.node == alert.node)
        return ctx.conn.execute(query.order_by(a.id.desc()).limit(1)).scalar()

    # -- moving them along ----------------------------------------------------------------------

    def _advance(self, ctx: Ctx, row: Any) -> None:
        if row.state == "proposed":
            if row.mode == "require-ack" and row.alert_id is not None:
                acked = ctx.conn.execute(
                    select(m.alerts.c.acked_by).where(
                        m.alerts.c.id == row.alert_id, m.alerts.c.acked_at.is_not(None)
                    )
                ).scalar()
                if acked is not None:
                    self._set(
                        ctx,
                        row,
                        "approved",
                        by=acked,
                        detail="its alert was acknowledged",
                        approver=acked,
                    )
            return
        if row.state == "approved":
            {
                "rollback": self._start_rollback,
                "evict": self._start_evict,
                "stop": self._start_stop,
            }[row.kind](ctx, row)
            return
        {
            "rollback": self._executing_rollback,
            "evict": self._executing_evict,
            "stop": self._executing_stop,
        }[row.kind](ctx, row)
