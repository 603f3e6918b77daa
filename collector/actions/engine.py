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
- **Evict**: the node goes through the scheduler backend (``collector/actions/evict.py``:
  Slurm, Kubernetes, a command), then the node's ranks get a *stop* command and exit
  with ``STOPPED_EXIT_CODE`` so the launcher restarts the job without them.

Every state change is also an event of the run (kind ``action``), for the timeline; a
failed action is an ``action_failed`` event, which the ActionFailed rule pages.
One collector runs the engine at a time (an advisory lock), as for alerts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy import Connection, Engine, and_, insert, or_, select, update

from trainwarden.alerts.intervals import Duration, Interval
from trainwarden.alerts.rules import Rule
from trainwarden.collector.actions.evict import Eviction, load_backend
from trainwarden.collector.actions.rollback_check import (
    MIN_STEPS,
    check_replay,
    checkable,
    steps_needed,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import leads, write

log = logging.getLogger(__name__)

ADVISORY_LOCK_KEY = 0x7477_6163_7473  # "twacts"
Mode = Literal["auto", "require-ack", "dry-run"]
Kind = Literal["rollback", "evict", "stop"]
ACTIVE = ("proposed", "approved", "executing")
LIVE_RANKS = ("healthy", "slow", "hung", "running")
STOP_TIMEOUT_S = 60.0
"""A stop is done once every rank acknowledged it or is gone, or after this long."""


# -- policy -------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Budget(_Strict):
    count: int = Field(default=3, ge=1)
    per: Duration = Interval(6 * 3600.0, "s")


class RollbackPolicy(_Strict):
    mode: Mode = "dry-run"
    margin_steps: int = Field(
        default=3,
        ge=0,
        description="steps before the newest clean checkpoint step (onset - 2) that the "
        "checkpoint must also precede: with the default, at least 5 steps before the onset",
    )
    skip_margin_steps: int = Field(
        default=10, ge=0, description="skip this far past the newest step"
    )
    lr_scale: float | None = Field(default=None, gt=0, le=1)
    budget: Budget = Budget()
    prepare_timeout: Duration = Interval(15.0, "s")
    """How long every rank has to answer the prepare (the others hold meanwhile)."""
    apply_timeout: Duration = Interval(120.0, "s")
    attempts: int = Field(default=3, ge=1, description="prepares tried before giving up")
    verify_steps: int = Field(
        default=MIN_STEPS,
        ge=0,
        description="steps run again after the restore on which the alert's rule must no "
        "longer hold before the rollback is done (at least the rule's window; 0: no check)",
    )
    verify_timeout: Duration = Interval(300.0, "s")
    """How long to wait for those steps; then the rollback is done, unchecked, and says so."""


class EvictPolicy(_Strict):
    mode: Mode = "dry-run"
    backend: dict[str, Any] | None = None
    """``collector/actions/evict.py``'s ``load_backend`` spec, e.g. ``{backend: slurm}``."""
    max_nodes_fraction_per_hour: float = Field(default=0.25, gt=0, le=1)
    cooldown: Duration = Interval(600.0, "s")
    timeout: Duration = Interval(30.0, "s")

    @field_validator("backend")
    @classmethod
    def _known(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            load_backend(value)  # raises ValueError naming the field
        return value


class StopPolicy(_Strict):
    mode: Mode = "dry-run"


class ActionPolicy(_Strict):
    rollback: RollbackPolicy = RollbackPolicy()
    evict: EvictPolicy = EvictPolicy()
    stop: StopPolicy = StopPolicy()

    def of(self, kind: str) -> Any:
        return getattr(self, kind)


class ActionConfigError(ValueError):
    """An actions file that cannot be used: file, field and problem on each line."""


def load_policy(path: Path | str | None) -> ActionPolicy:
    if path is None:
        return ActionPolicy()
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        return ActionPolicy.model_validate(doc)
    except OSError as exc:
        raise ActionConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ActionConfigError(f"{path}: YAML syntax error: {exc}") from None
    except ValidationError as exc:
        lines = [f"{path}: {'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ActionConfigError("\n".join(lines)) from None


# -- commands waiting for agents ------------------------------------------------------


class CommandBoard:
    """Which runs have commands waiting, so that ingest looks for them only then."""

    def __init__(self) -> None:
        self.runs: set[str] = set()

    def refresh(self, conn: Connection) -> None:
        c = m.agent_commands.c
        self.runs = set(
            conn.execute(
                select(m.runs.c.name)
                .distinct()
                .join(m.agent_commands, c.run_id == m.runs.c.id)
                .where(c.done_at.is_(None))
            ).scalars()
        )

    def take(self, conn: Connection, run: str, rank: int, now: float) -> list[dict[str, Any]]:
        """The commands for ``rank`` of ``run`` not yet acknowledged (sent again until they are)."""
        if run not in self.runs:
            return []
        c = m.agent_commands.c
        rows = conn.execute(
            select(c.id, c.body, c.delivered_at)
            .join(m.runs, m.runs.c.id == c.run_id)
            .where(m.runs.c.name == run, c.rank == rank, c.done_at.is_(None))
            .order_by(c.id)
        ).all()
        fresh = [r.id for r in rows if r.delivered_at is None]
        if fresh:
            conn.execute(update(m.agent_commands).where(c.id.in_(fresh)).values(delivered_at=now))
        return [{"id": r.id, **r.body} for r in rows]


# -- the engine ---------------------------------------------------------------------------


@dataclass
class _Ctx:
    conn: Connection
    now: float
    events: list[dict[str, Any]] = field(default_factory=list)
    evictions: list[tuple[int, Any]] = field(default_factory=list)  # started after the commit


def _history(
    row: Any, state: str, by: str | None, detail: str | None, now: float
) -> list[dict[str, Any]]:
    return [*(row.history or []), {"at": now, "state": state, "by": by, "detail": detail}]


class ActionEngine:
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
            ctx = _Ctx(conn, now)
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
            _store_events(conn, ctx.events, now)
            self._close_commands(ctx)
            self.board.refresh(conn)
        # Only once the action is on record as executing: a pass whose transaction failed
        # leaves it approved, and must not have started the backend (it would run twice).
        timeout = self.policy.evict.timeout.value
        for action_id, eviction in ctx.evictions:
            self._evictions[action_id] = self._pool.submit(
                self.backend.evict, eviction, timeout_s=timeout
            )

    def _close_commands(self, ctx: _Ctx) -> None:
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

    def _triggers(self, ctx: _Ctx) -> None:
        a = m.alerts.c
        firing = ctx.conn.execute(
            select(m.alerts).where(a.state == "firing", a.action != "none", a.silenced_by.is_(None))
        ).all()
        for alert in firing:
            key = f"{alert.fingerprint}:{alert.id}"  # one action per episode of the alert
            seen = ctx.conn.execute(
                select(m.actions.c.id).where(
                    m.actions.c.fingerprint == key, m.actions.c.kind == alert.action
                )
            ).first()
            if seen is not None or self._covered(ctx, alert):
                continue
            create_action(
                ctx.conn,
                self.policy,
                run_id=alert.run_id,
                kind=alert.action,
                now=ctx.now,
                trigger=f"rule:{alert.rule}",
                alert_id=alert.id,
                fingerprint=key,
                rank=alert.rank,
                node=alert.node,
                detail=(alert.annotations or {}).get("description"),
            )

    def _covered(self, ctx: _Ctx, alert: Any) -> bool:
        """Whether an action of the run (for an eviction: of the node) already answers this
        alert: one rollback for a spike that every rank flags, one eviction per node. A dry
        run stands only for dry runs: it never holds back a real action, and it records
        one plan where the real thing would act once, not one per rank."""
        a = m.actions.c
        dry = (
            a.mode == "dry-run"
            if self.policy.of(alert.action).mode == "dry-run"
            else a.mode != "dry-run"
        )
        query = select(a.id).where(
            a.run_id == alert.run_id,
            a.kind == alert.action,
            dry,
            or_(a.state.in_(ACTIVE), a.created_at >= alert.active_since - 60),
        )
        if alert.action == "evict":
            query = query.where(a.node == alert.node)
        return ctx.conn.execute(query.limit(1)).first() is not None

    # -- moving them along ----------------------------------------------------------------------

    def _advance(self, ctx: _Ctx, row: Any) -> None:
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

    def _set(
        self,
        ctx: _Ctx,
        row: Any,
        state: str,
        *,
        by: str | None = None,
        detail: str | None = None,
        **values: Any,
    ) -> None:
        ctx.conn.execute(
            update(m.actions)
            .where(m.actions.c.id == row.id)
            .values(
                state=state,
                updated_at=ctx.now,
                history=_history(row, state, by, detail, ctx.now),
                **values,
            )
        )
        ctx.events.append(_event(row, state, detail, ctx.now))

    def _finish(
        self, ctx: _Ctx, row: Any, state: str, *, reason: str | None = None, result: Any = None
    ) -> None:
        values: dict[str, Any] = {"finished_at": ctx.now}
        if reason is not None:
            values["reason"] = reason[:2000]
        if result is not None:
            values["result"] = result
        self._set(ctx, row, state, detail=reason, **values)
        ctx.conn.execute(
            update(m.agent_commands)
            .where(m.agent_commands.c.action_id == row.id, m.agent_commands.c.done_at.is_(None))
            .values(done_at=ctx.now)
        )
        if state == "failed":
            ctx.events.append(
                {
                    **_event(row, "failed", reason, ctx.now),
                    "kind": "action_failed",
                    "severity": "critical",
                }
            )

    # -- rollback ---------------------------------------------------------------------------------

    def _start_rollback(self, ctx: _Ctx, row: Any) -> None:
        pol = self.policy.rollback
        # Spent: every rollback of the period that reached the ranks, whether it is running,
        # done, or failed once it had started (a rollback that fails at the ranks again and
        # again must stop the run, not retry forever); one that failed before it started
        # (no good checkpoint, a dry run) touched nothing.
        spent = [
            a
            for a in ctx.conn.execute(
                select(m.actions.c.id, m.actions.c.state, m.actions.c.history).where(
                    m.actions.c.run_id == row.run_id,
                    m.actions.c.kind == "rollback",
                    m.actions.c.id != row.id,
                    m.actions.c.state.in_(("executing", "done", "failed")),
                    m.actions.c.mode != "dry-run",
                    m.actions.c.created_at > ctx.now - pol.budget.per.value,
                )
            ).all()
            if a.state != "failed" or any(h.get("state") == "executing" for h in a.history or ())
        ]
        before = (row.plan or {}).get(
            "restores"
        ) or []  # this action's restores that did not fix it
        if len(spent) + len(before) >= pol.budget.count:
            why = f"retry budget spent: {len(spent) + len(before)} rollbacks within {pol.budget.per}; stopping the run instead"
            if before:
                why = f"{_not_fixed(before[-1])}; {why}"
            self._finish(ctx, row, "failed", reason=why)
            create_action(
                ctx.conn,
                self.policy,
                run_id=row.run_id,
                kind="stop",
                now=ctx.now,
                trigger="budget",
                detail="rollback budget spent",
                mode="auto",
                fingerprint=f"budget:{row.id}",
                approver="policy",
            )
            return
        plan, problem = rollback_plan(ctx.conn, row, pol)
        if plan is None:
            if before:
                problem = f"{_not_fixed(before[-1])}, and no older clean checkpoint: {problem}"
            self._finish(ctx, row, "failed", reason=problem)
            return
        a = m.actions.c
        busy = ctx.conn.execute(
            select(a.id).where(
                a.run_id == row.run_id, a.kind == "rollback", a.id != row.id, a.state == "executing"
            )
        ).scalar()
        if busy is not None:  # two rollbacks at once would race for the ranks' hold
            self._finish(
                ctx,
                row,
                "failed",
                reason=f"rollback {busy} of this run is executing; not starting a second one",
            )
            return
        attempt = (row.plan or {}).get("attempt", 0) + 1
        plan.update(
            _carried(row.plan), attempt=attempt
        )  # an operator's checkpoint, earlier restores
        ranks = _live_ranks(ctx.conn, row.run_id)
        if not ranks:
            self._finish(ctx, row, "failed", reason="no live rank to roll back")
            return
        plan["ranks"] = ranks
        plan["prepared_at"] = ctx.now
        _commands(
            ctx.conn,
            row,
            ranks,
            {
                "type": "rollback",
                "phase": "prepare",
                "action": row.id,
                "attempt": attempt,
                "plan": plan["rollback"],
            },
            ctx.now,
        )
        self._set(
            ctx,
            row,
            "executing",
            detail=f"prepare: every rank holds at its next step (attempt {attempt})",
            plan=plan,
        )

    def _executing_rollback(self, ctx: _Ctx, row: Any) -> None:
        pol = self.policy.rollback
        plan = dict(row.plan)
        if "restored_at" in plan:
            self._verify_rollback(ctx, row, plan)
            return
        acks = _acks(ctx.conn, row, since=plan["prepared_at"], phase="prepare")
        ranks = plan["ranks"]
        if "committed_at" not in plan:
            prepared = {
                r: acks[r] for r in ranks if r in acks and acks[r].get("phase") == "prepare"
            }
            refused = {r: a for r, a in prepared.items() if not a.get("armed")}
            refused |= {
                r: {**a, "error": "stopped holding: no decision within its wait"}
                for r, a in acks.items()
                if r in ranks and a.get("phase") == "timeout"
            }
            if refused or ctx.now - plan["prepared_at"] > pol.prepare_timeout.value:
                why = (
                    "; ".join(f"rank {r}: {a.get('error')}" for r, a in sorted(refused.items()))
                    or f"ranks {sorted(set(ranks) - set(prepared))} did not answer within {pol.prepare_timeout}"
                )
                fatal = any("on_rollback" in str(a.get("error")) for a in refused.values())
                tries = plan["attempt"] - plan.get("round_start", 1) + 1  # of this restore
                if tries >= pol.attempts or fatal:
                    self._finish(ctx, row, "failed", reason=f"ranks not ready: {why}")
                    # After _finish closed the action's other commands: this one must go out,
                    # or an armed rank holds at the barrier until its decision timeout.
                    # _close_commands closes it once the ranks have had time to take it.
                    abort = {
                        "type": "rollback",
                        "phase": "abort",
                        "action": row.id,
                        "attempt": plan["attempt"],
                    }
                    _commands(ctx.conn, row, ranks, abort, ctx.now)
                else:  # try again
                    # Decisions are per attempt: this abort frees the ranks holding now,
                    # and cannot decide the next attempt.
                    ctx.conn.execute(
                        update(m.agent_commands)
                        .where(m.agent_commands.c.action_id == row.id)
                        .values(done_at=ctx.now)
                    )
                    abort = {
                        "type": "rollback",
                        "phase": "abort",
                        "action": row.id,
                        "attempt": plan["attempt"],
                    }
                    _commands(ctx.conn, row, ranks, abort, ctx.now)
                    self._set(
                        ctx,
                        row,
                        "approved",
                        detail=f"aborted attempt {plan['attempt']}: {why}",
                        plan=_carried(plan),
                    )
                return
            if len(prepared) == len(ranks):
                # Each rank holds at most one step past the step it answered with: none can
                # be past the newest + 1, and in lockstep none is more than one step short.
                answered = {r: int(a.get("step") or 0) for r, a in prepared.items()}
                barrier = max(answered.values()) + 1
                skip_to = barrier + pol.skip_margin_steps
                commit = {
                    "type": "rollback",
                    "phase": "commit",
                    "action": row.id,
                    "attempt": plan["attempt"],
                    "barrier_step": barrier,
                    "skip_to": skip_to,
                }
                _commands(ctx.conn, row, ranks, commit, ctx.now)
                plan.update(
                    committed_at=ctx.now,
                    barrier_step=barrier,
                    answered_at_step=min(answered.values()),
                )
                plan["rollback"] = {**plan["rollback"], "skip_to": skip_to}
                self._set(
                    ctx,
                    row,
                    "executing",
                    detail=f"commit: every rank holds; restore after step {barrier}",
                    plan=plan,
                )
            return
        done = {
            r: acks[r]
            for r in ranks
            if r in acks and acks[r].get("phase") in ("commit", "abort", "timeout")
        }
        failed = {r: a for r, a in done.items() if not a.get("applied")}
        if failed:
            why = "; ".join(
                f"rank {r}: {a.get('error') or a.get('decision')}"
                for r, a in sorted(failed.items())
            )
            self._finish(ctx, row, "failed", reason=f"rollback not applied: {why}")
        elif len(done) == len(ranks):
            result = {
                "ranks": {
                    str(r): {
                        k: done[r].get(k)
                        for k in ("barrier_step", "checkpoint_step", "seconds", "at")
                    }
                    for r in ranks
                },
                "restored_within_s": round(
                    max(a["at"] for a in done.values()) - plan["committed_at"], 3
                ),
                "since_prepare_s": round(
                    max(a["at"] for a in done.values()) - plan["prepared_at"], 3
                ),
                # steps run from the command reaching the ranks to the restore
                "steps_after_command": plan["barrier_step"] - plan["answered_at_step"],
                "steps_after_issue": plan["barrier_step"] - plan["issued_at_step"],
            }
            if plan.get("restores"):
                result["restores"] = plan["restores"]
            rule = self._rule_of(ctx, row)
            if rule is None or pol.verify_steps == 0 or not checkable(rule):
                self._finish(ctx, row, "done", result=result)
                return
            step = plan["rollback"]["checkpoint_step"]
            plan.update(
                restored_at=ctx.now,
                result=result,
                rule=rule.name,
                restored_ts=min(float(a.get("ts") or ctx.now) for a in done.values()),
            )
            self._set(
                ctx,
                row,
                "executing",
                detail=f"every rank restored the checkpoint of step {step}; "
                f"checking {rule.name} on the steps run again",
                plan=plan,
            )
        elif ctx.now - plan["committed_at"] > pol.apply_timeout.value:
            self._finish(
                ctx,
                row,
                "failed",
                reason=f"ranks {sorted(set(ranks) - set(done))} did not restore within {pol.apply_timeout}",
            )

    def _rule_of(self, ctx: _Ctx, row: Any) -> Rule | None:
        if row.alert_id is None:
            return None  # an operator's rollback: no rule to ask
        name = ctx.conn.execute(
            select(m.alerts.c.rule).where(m.alerts.c.id == row.alert_id)
        ).scalar()
        return self.rules.get(name) if name is not None else None

    def _verify_rollback(self, ctx: _Ctx, row: Any, plan: dict[str, Any]) -> None:
        """Every rank restored: done once the alert's rule no longer holds on the steps
        run again; if it still does, the checkpoint was bad too, and the rollback goes
        again to an older clean one (:meth:`_start_rollback` keeps the budget)."""
        pol = self.policy.rollback
        rule = self.rules.get(plan["rule"])
        result = dict(plan["result"])
        step = plan["rollback"]["checkpoint_step"]
        if rule is None:
            self._finish(
                ctx,
                row,
                "done",
                result={**result, "check": f"not checked: rule {plan['rule']} is no longer loaded"},
            )
            return
        check = check_replay(
            ctx.conn,
            rule=rule,
            run_id=row.run_id,
            ranks=plan["ranks"],
            checkpoint_step=step,
            since_ts=plan["restored_ts"],
            need=steps_needed(rule, pol.verify_steps),
            now=ctx.now,
        )
        if not check.ready:
            gone = _gone(ctx.conn, row.run_id, plan["ranks"])
            if gone or ctx.now - plan["restored_at"] > pol.verify_timeout.value:
                why = f"ranks {sorted(gone)} ended" if gone else f"waited {pol.verify_timeout}"
                self._finish(
                    ctx,
                    row,
                    "done",
                    result={**result, "check": f"not checked: {check.detail} ({why})"},
                )
            return
        if not check.holds:
            self._finish(ctx, row, "done", result={**result, "check": check.detail})
            return
        restores = [
            *(plan.get("restores") or []),
            {"checkpoint_step": step, "steps": list(check.steps or ()), "detail": check.detail},
        ]
        # Decisions are per attempt: the commands of this one are over.
        ctx.conn.execute(
            update(m.agent_commands)
            .where(m.agent_commands.c.action_id == row.id)
            .values(done_at=ctx.now)
        )
        again = {
            **_carried(plan),
            "restores": restores,
            "below_step": step,
            "round_start": plan["attempt"] + 1,
        }
        self._set(
            ctx,
            row,
            "approved",
            detail=f"{_not_fixed(restores[-1])}; rolling back to an older checkpoint",
            plan=again,
        )

    # -- stop --------------------------------------------------------------------------------------

    def _start_stop(self, ctx: _Ctx, row: Any) -> None:
        ranks = [row.rank] if row.rank is not None else _live_ranks(ctx.conn, row.run_id)
        reason = f"trainwarden: {row.trigger}" + (f" ({row.reason})" if row.reason else "")
        _commands(
            ctx.conn, row, ranks, {"type": "stop", "action": row.id, "reason": reason}, ctx.now
        )
        self._set(
            ctx,
            row,
            "executing",
            detail=f"stop sent to ranks {ranks}",
            plan={"ranks": ranks, "sent_at": ctx.now},
        )

    def _executing_stop(self, ctx: _Ctx, row: Any) -> None:
        acks = _acks(ctx.conn, row, since=row.plan["sent_at"], phase="stop")
        ranks = row.plan["ranks"]
        gone = _gone(ctx.conn, row.run_id, ranks)
        late = ctx.now - row.plan["sent_at"] > STOP_TIMEOUT_S  # a hung rank never hears it
        if late or all(r in acks or r in gone for r in ranks):
            result = {
                "stopped": sorted(acks),
                "already_gone": sorted(set(gone) - set(acks)),
                "no_answer": sorted(set(ranks) - set(acks) - set(gone)),
            }
            self._finish(ctx, row, "done", result=result)

    # -- evict -----------------------------------------------------------------------------------------

    def _start_evict(self, ctx: _Ctx, row: Any) -> None:
        pol = self.policy.evict
        if not row.node:
            self._finish(ctx, row, "failed", reason="no node to evict (the alert names no node)")
            return
        if self.backend is None:
            self._finish(
                ctx,
                row,
                "failed",
                reason="no eviction backend configured (actions file: evict.backend)",
            )
            return
        a = m.actions.c
        recent = ctx.conn.execute(
            select(a.node, a.finished_at).where(
                a.run_id == row.run_id,
                a.kind == "evict",
                a.id != row.id,
                or_(
                    a.state == "executing", and_(a.state == "done", a.finished_at > ctx.now - 3600)
                ),
            )
        ).all()
        nodes = {
            n
            for (n,) in ctx.conn.execute(
                select(m.ranks.c.node).distinct().where(m.ranks.c.run_id == row.run_id)
            )
            if n
        }
        evicted = {r.node for r in recent}
        if row.node not in evicted and len(evicted | {row.node}) > max(
            1, math.floor(pol.max_nodes_fraction_per_hour * len(nodes))
        ):  # one node is always allowed
            self._finish(
                ctx,
                row,
                "failed",
                reason=f"blast-radius guard: evicting {row.node} would make {len(evicted) + 1} of the run's {len(nodes)} nodes within an hour (limit {pol.max_nodes_fraction_per_hour:.0%})",
            )
            return
        last = max((r.finished_at or ctx.now for r in recent), default=None)
        if last is not None and ctx.now - last < pol.cooldown.value:
            return  # waits (approved) until the cool-down after the last eviction has passed
        ranks = tuple(
            r
            for (r,) in ctx.conn.execute(
                select(m.ranks.c.rank).where(
                    m.ranks.c.run_id == row.run_id, m.ranks.c.node == row.node
                )
            )
        )
        run = ctx.conn.execute(select(m.runs.c.name).where(m.runs.c.id == row.run_id)).scalar_one()
        try:
            eviction = Eviction(
                node=row.node,
                run=run,
                ranks=ranks,
                reason=f"trainwarden: {row.trigger.removeprefix('rule:')} {row.reason or ''}".strip(),
            )
        except ValueError as exc:
            self._finish(ctx, row, "failed", reason=f"cannot evict {row.node!r}: {exc}")
            return
        ctx.evictions.append((row.id, eviction))
        self._set(
            ctx,
            row,
            "executing",
            detail=f"evicting {row.node} through {self.backend.name}",
            plan={
                "node": row.node,
                "ranks": list(ranks),
                "backend": self.backend.name,
                "started_at": ctx.now,
            },
        )

    def _executing_evict(self, ctx: _Ctx, row: Any) -> None:
        plan = dict(row.plan)
        if "evicted_at" not in plan:
            future = self._evictions.get(row.id)
            if future is None:  # the collector restarted while the backend ran: do not run it twice
                self._finish(
                    ctx,
                    row,
                    "failed",
                    reason="interrupted: the collector restarted during the eviction; check the node by hand",
                )
                return
            if not future.done():
                return
            self._evictions.pop(row.id)
            try:
                result = future.result()
            except Exception as exc:
                done = "; ".join(getattr(exc, "steps", ()) or ())
                self._finish(
                    ctx,
                    row,
                    "failed",
                    reason=f"{type(exc).__name__}: {exc}"
                    + (f" (done before: {done})" if done else ""),
                )
                return
            plan.update(
                evicted_at=ctx.now, steps=list(result.steps), output=str(result.output)[:2000]
            )
            reason = f"node {row.node} evicted by trainwarden ({row.trigger})"
            _commands(
                ctx.conn,
                row,
                plan["ranks"],
                {"type": "stop", "action": row.id, "reason": reason},
                ctx.now,
            )
            self._set(
                ctx,
                row,
                "executing",
                detail=f"{row.node} evicted ({'; '.join(result.steps)}); stopping its ranks {plan['ranks']}",
                plan=plan,
            )
            return
        acks = _acks(ctx.conn, row, since=plan["evicted_at"], phase="stop")
        gone = _gone(ctx.conn, row.run_id, plan["ranks"])
        if all(r in acks or r in gone for r in plan["ranks"]) or ctx.now - plan["evicted_at"] > 60:
            result = {
                "node": row.node,
                "steps": plan["steps"],
                "drained_within_s": round(plan["evicted_at"] - row.created_at, 3),
                "ranks_stopped": sorted(acks),
                "ranks_gone": sorted(set(gone) - set(acks)),
            }
            self._finish(ctx, row, "done", result=result)


# -- helpers ------------------------------------------------------------------------------------


def summary(kind: str, state: str, result: dict[str, Any] | None, reason: str | None) -> str:
    """What an action did, in a line (the UI's actions table, the demo's closing list):
    what a dry run would have done, what a done one did, else why it failed or waits."""
    result = result or {}
    if result.get("dry_run"):
        would = dict(result.get("would") or {})
        extra = ""
        if kind == "evict" and would.get("backend") is None:
            would.pop("backend", None)
            extra = " (no eviction backend is configured)"
        what = ", ".join(f"{k} {v}" for k, v in would.items() if v not in (None, [], {}, ""))
        problem = f"; problem: {result['problem']}" if result.get("problem") else ""
        return f"dry run, nothing done; would {kind}: {what}{extra}{problem}"
    if state in ("failed", "cancelled") and reason:
        return reason
    if state != "done" or not result:
        return reason or "—"
    if kind == "rollback" and result.get("ranks"):
        ranks = [r for r in result["ranks"].values() if isinstance(r, dict)]
        at = sorted(
            {str(r["checkpoint_step"]) for r in ranks if r.get("checkpoint_step") is not None}
        )
        after = sorted({str(r["barrier_step"]) for r in ranks if r.get("barrier_step") is not None})
        took = result.get("restored_within_s")
        earlier = [str(r.get("checkpoint_step")) for r in result.get("restores") or []]
        return (
            f"every rank ({len(ranks)}) restored the checkpoint of step {', '.join(at)} "
            f"after step {', '.join(after)}"
            + (f", {took} s after the commit" if took is not None else "")
            + (f" (the restore of step {', '.join(earlier)} had not fixed it)" if earlier else "")
            + (f"; {result['check']}" if result.get("check") else "")
        )
    if kind == "evict" and result.get("node"):
        stopped = result.get("ranks_stopped") or []
        return (
            f"node {result['node']} evicted ({'; '.join(result.get('steps') or [])}); "
            f"ranks stopped: {stopped or 'none'}"
        )
    if kind == "stop" and "stopped" in result:
        gone, silent = result.get("already_gone") or [], result.get("no_answer") or []
        return (
            f"ranks stopped: {result['stopped'] or 'none'}"
            + (f"; already gone: {gone}" if gone else "")
            + (f"; no answer: {silent}" if silent else "")
        )
    return ", ".join(f"{k} {v}" for k, v in result.items())


def create_action(
    conn: Connection,
    policy: ActionPolicy,
    *,
    run_id: int,
    kind: str,
    now: float,
    trigger: str,
    alert_id: int | None = None,
    fingerprint: str | None = None,
    rank: int | None = None,
    node: str | None = None,
    detail: str | None = None,
    mode: str | None = None,
    approver: str | None = None,
    plan: dict[str, Any] | None = None,
) -> int:
    """A new action: approved at once under ``auto`` (or when an operator asks), left
    proposed under ``require-ack``, planned and closed under ``dry-run``."""
    mode = mode or policy.of(kind).mode
    state = {"auto": "approved", "require-ack": "proposed", "dry-run": "approved"}[mode]
    if approver is not None and mode == "require-ack":
        state = "approved"
    history = [{"at": now, "state": "proposed", "by": trigger, "detail": detail}]
    if state == "approved":
        history.append(
            {
                "at": now,
                "state": "approved",
                "by": approver or ("policy" if mode == "auto" else "dry-run"),
                "detail": None,
            }
        )
    action_id = conn.execute(
        insert(m.actions)
        .values(
            run_id=run_id,
            kind=kind,
            state=state,
            mode=mode,
            trigger=trigger,
            alert_id=alert_id,
            fingerprint=fingerprint,
            rank=rank,
            node=node,
            approver=approver or ("policy" if state == "approved" and mode == "auto" else None),
            plan=plan,
            reason=detail[:2000] if detail else None,
            history=history,
            created_at=now,
            updated_at=now,
        )
        .returning(m.actions.c.id)
    ).scalar_one()
    if mode == "dry-run":
        _dry_run(conn, policy, action_id, now)
        state = "done"
    _store_events(
        conn,
        [
            {
                "run_id": run_id,
                "kind": "action",
                "severity": "warning",
                "rank": rank,
                "data": {
                    "action": action_id,
                    "type": kind,
                    "state": state,
                    "trigger": trigger,
                    "mode": mode,
                },
            }
        ],
        now,
    )
    return action_id


def _dry_run(conn: Connection, policy: ActionPolicy, action_id: int, now: float) -> None:
    row = conn.execute(select(m.actions).where(m.actions.c.id == action_id)).one()
    if row.kind == "rollback":
        plan, problem = rollback_plan(conn, row, policy.rollback)
        would = plan["rollback"] if plan else None
    elif row.kind == "evict":
        would, problem = (
            {"node": row.node, "backend": (policy.evict.backend or {}).get("backend")},
            None,
        )
    else:
        would, problem = (
            {"ranks": [row.rank] if row.rank is not None else _live_ranks(conn, row.run_id)},
            None,
        )
    result = {"dry_run": True, "would": would, "problem": problem}
    conn.execute(
        update(m.actions)
        .where(m.actions.c.id == action_id)
        .values(
            state="done",
            result=result,
            finished_at=now,
            updated_at=now,
            history=_history(
                row,
                "done",
                "dry-run",
                "dry run: nothing was done" + (f" ({problem})" if problem else ""),
                now,
            ),
        )
    )


def rollback_plan(
    conn: Connection, row: Any, pol: RollbackPolicy
) -> tuple[dict[str, Any] | None, str | None]:
    """The newest checkpoint before the anomaly's onset and the data to skip (the end of
    the window is set again at commit, from the barrier)."""
    run = conn.execute(select(m.runs).where(m.runs.c.id == row.run_id)).one()
    onset_step, onset_ts = run.last_step or 0, math.inf
    given = (row.plan or {}).get("checkpoint_step")
    below = (row.plan or {}).get("below_step")  # a restore of it did not fix the anomaly
    if row.alert_id is not None:
        alert = conn.execute(select(m.alerts).where(m.alerts.c.id == row.alert_id)).one()
        onset_step = onset_of(alert) or onset_step
        onset_ts = alert.active_since
    e = m.events.c
    ckpts = [
        (s, ts, (d or {}).get("path"))
        for s, ts, d in conn.execute(
            select(e.step, e.ts, e.data).where(
                e.run_id == row.run_id, e.kind == "checkpoint", e.step.is_not(None)
            )
        )
    ]
    if given is not None:
        good = [c for c in ckpts if c[0] == given]
        if not good:
            return (
                None,
                f"no checkpoint of step {given} was reported (known: {sorted({c[0] for c in ckpts})})",
            )
    else:
        limit = clean_limit(onset_step, pol.margin_steps)
        if below is not None:
            limit = min(limit, below - 1)
        good = [c for c in ckpts if c[0] <= limit and c[1] < onset_ts]
        if not good:
            known = sorted({c[0] for c in ckpts})[-5:]
            older = f", older than step {below}" if below is not None else ""
            return None, (
                f"no checkpoint at or before step {limit} (onset {onset_step} - 2 - margin {pol.margin_steps}{older}); "
                f"reported: {known or 'none (call tw.checkpoint_saved)'}"
            )
    step, _, path = max(good, key=lambda c: (c[0], c[1]))
    newest = max(
        (
            r
            for (r,) in conn.execute(
                select(m.ranks.c.last_step).where(m.ranks.c.run_id == row.run_id)
            )
            if r is not None
        ),
        default=run.last_step or 0,
    )
    plan = {
        "issued_at_step": newest,
        "onset_step": onset_step,
        "rollback": {
            "checkpoint_step": step,
            "checkpoint_path": path or "",
            "skip_from": step + 1,
            "skip_to": newest + pol.skip_margin_steps,
            "lr_scale": pol.lr_scale,
            "reason": f"{row.trigger}: onset at step {onset_step}",
        },
    }
    return plan, None


def onset_of(alert: Any) -> int | None:
    """Where an alert's anomaly began: its onset in the data (``onset_step``); for an alert
    stored before that was kept, the earliest step a pass saw it at."""
    if alert.onset_step is not None:
        return int(alert.onset_step)
    steps = [s for s in (alert.step, alert.active_since_step) if s is not None]
    return min(steps) if steps else None


def clean_limit(onset_step: int, margin_steps: int) -> int:
    """The newest checkpoint step that is clean for an anomaly whose onset is step
    ``onset_step``. A checkpoint reported as ``tw.checkpoint_saved(s)`` holds the weights
    after the update of step s; the loss of step k is computed with the weights after
    update k - 1, so the update that caused an anomaly seen at k is k - 1 at the latest,
    and a checkpoint is clean iff s <= k - 2. ``margin_steps`` more for safety."""
    return onset_step - 2 - margin_steps


def _carried(plan: dict[str, Any] | None) -> dict[str, Any]:
    """What a rollback's next attempt keeps of the plan: the attempt count, an operator's
    checkpoint, and the restores that did not fix the anomaly (with the bound they set)."""
    keys = ("attempt", "checkpoint_step", "below_step", "restores", "round_start")
    return {k: v for k, v in (plan or {}).items() if k in keys}


def _not_fixed(restore: dict[str, Any]) -> str:
    steps = restore.get("steps") or []
    on = f" (steps {steps[0]}-{steps[-1]} run again)" if len(steps) == 2 else ""
    return f"the restore of the checkpoint of step {restore['checkpoint_step']} did not fix it{on}: {restore['detail']}"


def checkpoints(conn: Connection, run_id: int, *, margin_steps: int) -> list[dict[str, Any]]:
    """The checkpoints the trainer reported (``tw.checkpoint_saved``), oldest first, each
    good or suspect. Suspect: saved before an anomaly whose rule rolls back (LossSpike,
    NonFiniteLoss, ...) had cleared, and either while it was active or of a step past its
    clean limit (:func:`clean_limit`: onset - 2 - ``margin_steps``). Once the anomaly
    cleared, new checkpoints are good again."""
    a = m.alerts.c
    anomalies = conn.execute(
        select(
            a.id, a.rule, a.active_since, a.cleared_at, a.step, a.active_since_step, a.onset_step
        )
        .where(a.run_id == run_id, a.action == "rollback")
        .order_by(a.active_since)
    ).all()
    e = m.events.c
    out = []
    for step, ts, rank, data in conn.execute(
        select(e.step, e.ts, e.rank, e.data)
        .where(e.run_id == run_id, e.kind == "checkpoint", e.step.is_not(None))
        .order_by(e.ts, e.id)
    ):
        data = dict(data or {})
        suspect = None
        for al in anomalies:
            onset = onset_of(al)
            if al.cleared_at is not None and ts >= al.cleared_at:
                continue
            if ts >= al.active_since or (
                onset is not None and step > clean_limit(onset, margin_steps)
            ):
                suspect = f"saved before {al.rule} (alert {al.id}, onset at step {onset}) cleared"
                break
        out.append(
            {
                "step": step,
                "path": data.pop("path", None),
                "ts": ts,
                "rank": rank,
                "meta": data,
                "good": suspect is None,
                "suspect": suspect,
            }
        )
    return out


def _live_ranks(conn: Connection, run_id: int) -> list[int]:
    k = m.ranks.c
    return sorted(
        conn.execute(select(k.rank).where(k.run_id == run_id, k.state.in_(LIVE_RANKS))).scalars()
    )


def _gone(conn: Connection, run_id: int, ranks: Sequence[int]) -> set[int]:
    k = m.ranks.c
    return set(
        conn.execute(
            select(k.rank).where(
                k.run_id == run_id,
                k.rank.in_(list(ranks)),
                k.state.in_(("dead", "finished", "failed")),
            )
        ).scalars()
    )


def _commands(
    conn: Connection, row: Any, ranks: Sequence[int], body: dict[str, Any], now: float
) -> None:
    if not ranks:  # an empty executemany would insert one row of defaults (and fail)
        return
    conn.execute(
        insert(m.agent_commands),
        [
            {"action_id": row.id, "run_id": row.run_id, "rank": r, "body": body, "created_at": now}
            for r in ranks
        ],
    )


def _acks(conn: Connection, row: Any, *, since: float, phase: str) -> dict[int, dict[str, Any]]:
    """Each rank's latest acknowledgement (``command_ack`` events) of this action's
    commands of ``phase`` (prepare, stop) sent since ``since``: a rollback's commit or
    abort is acknowledged under the id of the prepare it decides."""
    c = m.agent_commands.c
    ids = {
        i
        for i, body, at in conn.execute(
            select(c.id, c.body, c.created_at).where(c.action_id == row.id)
        )
        if at >= since and (body.get("phase") or body.get("type")) == phase
    }
    e = m.events.c
    out: dict[int, dict[str, Any]] = {}
    for rank, step, ts, recv_ts, data in conn.execute(
        select(e.rank, e.step, e.ts, e.recv_ts, e.data)
        .where(e.run_id == row.run_id, e.kind == "command_ack", e.recv_ts >= since)
        .order_by(e.id)
    ):
        if (data or {}).get("command") in ids and rank is not None:
            out[rank] = {**data, "step": step, "at": recv_ts, "ts": ts}
    return out


def _event(row: Any, state: str, detail: str | None, now: float) -> dict[str, Any]:
    return {
        "run_id": row.run_id,
        "kind": "action",
        "severity": "critical" if state == "failed" else "warning",
        "rank": row.rank,
        "data": {
            "action": row.id,
            "type": row.kind,
            "state": state,
            "trigger": row.trigger,
            "detail": detail,
        },
    }


def _store_events(conn: Connection, events: list[dict[str, Any]], now: float) -> None:
    if events:
        conn.execute(
            insert(m.events),
            [
                {"uid": f"action:{uuid.uuid4().hex}", "ts": now, "recv_ts": now, "step": None, **ev}
                for ev in events
            ],
        )
