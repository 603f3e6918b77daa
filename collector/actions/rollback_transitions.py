"""A rollback's transitions: *prepare* (every rank holds), *commit* (all restore after one
barrier step) or *abort* and another attempt, then the check of its result on the steps
run again, and another rollback to an older clean checkpoint when the restore did not
fix it. The ranks' side is ``trainwarden.agent.commands``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update

from trainwarden.alerts.rules import Rule
from trainwarden.collector.actions.records import (
    LIVE_RANKS,
    create_action,
    gone_ranks,
    live_ranks,
    queue_commands,
    rank_acks,
    restarted_since,
)
from trainwarden.collector.actions.rollback import not_fixed, rollback_plan
from trainwarden.collector.actions.rollback_check import (
    check_replay,
    checkable,
    steps_needed,
)
from trainwarden.collector.actions.transitions import Ctx, Transitions
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import EvictPlan, Restore, RollbackPlan

BACK_TIMEOUT_S = 900.0
"""How long a rollback waits for every rank of the job to be live (a restart coming back)
before it fails and pages."""
AFTER_EVICT_TIMEOUT_S = 900.0
"""How long an ``evict+rollback`` rollback waits for the job to come back after the
eviction (a scheduler's requeue, a launcher's restart) before it fails and pages."""
ENDED_BEFORE_HOLDING = "its process ended before it held (the job finished, or it died)"
ENDED_BEFORE_RESTORING = "its process ended before it restored (the job finished, or it died)"


class RollbackTransitions(Transitions):
    def _start_rollback(self, ctx: Ctx, row: Any) -> None:
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
        stored = RollbackPlan.of(row.plan)
        before = stored.restores or []  # this action's restores that did not fix it
        if len(spent) + len(before) >= pol.budget.count:
            why = (
                f"retry budget spent: {len(spent) + len(before)} rollbacks within "
                f"{pol.budget.per}; stopping the run instead"
            )
            if before:
                why = f"{not_fixed(before[-1])}; {why}"
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
        back, ranks_back = self._back_after_eviction(ctx, row)
        if back == "wait":
            return  # stays approved: looked at again next pass
        if ranks_back is None:
            ranks_back = self._whole_job(ctx, row)
            if ranks_back is None:
                return  # stays approved until every rank of the job is live (or fails)
        plan, problem = rollback_plan(ctx.conn, row, pol)
        if plan is None:
            if before:
                problem = f"{not_fixed(before[-1])}, and no older clean checkpoint: {problem}"
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
        attempt = (stored.attempt or 0) + 1
        carried = stored.carried()  # an operator's checkpoint, earlier restores
        for key in carried.model_fields_set:
            setattr(plan, key, getattr(carried, key))
        plan.attempt = attempt
        ranks = ranks_back
        plan.ranks = ranks
        plan.prepared_at = ctx.now
        assert plan.rollback is not None  # rollback_plan makes it
        queue_commands(
            ctx.conn,
            row,
            ranks,
            {
                "type": "rollback",
                "phase": "prepare",
                "action": row.id,
                "attempt": attempt,
                "plan": plan.rollback.dump(),
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

    def _whole_job(self, ctx: Ctx, row: Any) -> list[int] | None:
        """The live ranks, once every rank of the job as it runs now (its current
        attempt's world) is live or has finished (its shard done); None while one is not
        (dead, failed, or a restarted process not yet back): a
        rollback restores every rank at the same step, or the ranks that did not go back
        run their collectives against ones that did (seen: gloo aborted on a mismatch
        when a rollback planned during a restart restored rank 0 alone). After
        :data:`BACK_TIMEOUT_S` of waiting, the rollback fails."""
        t = m.attempts.c
        world = (
            ctx.conn.execute(
                select(t.world_size)
                .where(t.run_id == row.run_id)
                .order_by(t.number.desc())
                .limit(1)
            ).scalar()
            or ctx.conn.execute(
                select(m.runs.c.world_size).where(m.runs.c.id == row.run_id)
            ).scalar()
        )
        live = set(live_ranks(ctx.conn, row.run_id))
        k = m.ranks.c
        finished = set(  # ended cleanly (its shard done): not waited for, not rolled back
            ctx.conn.execute(
                select(k.rank).where(k.run_id == row.run_id, k.state == "finished")
            ).scalars()
        )
        missing = sorted(set(range(world or 0)) - live - finished)
        if not missing:
            if not live:
                self._finish(ctx, row, "failed", reason="no live rank to roll back")
                return None
            return sorted(live & set(range(world))) if world else sorted(live)
        waited = ctx.now - _approved_at(row, ctx.now)
        if waited > BACK_TIMEOUT_S:
            self._finish(
                ctx,
                row,
                "failed",
                reason=f"ranks {missing} of {world} were not live for {BACK_TIMEOUT_S:.0f} s: "
                "a rollback restores every rank at the same step; restore a clean checkpoint "
                "by hand (GET /api/v1/runs/{run}/checkpoints marks them)",
            )
            return None
        detail = f"{WAITING} {missing} to be live: every rank restores at the same step"
        if (row.history or [{}])[-1].get("detail") != detail:
            self._set(ctx, row, "approved", detail=detail)
        return None

    def _back_after_eviction(self, ctx: Ctx, row: Any) -> tuple[str, list[int] | None]:
        """For the rollback of an ``evict+rollback`` rule: ``("wait", None)`` while its
        eviction runs and until the job is back without the node (a new attempt started
        after the eviction, each of its ranks live and past its first step), then
        ``("go", that attempt's ranks)``. ``("go", None)``: no eviction to wait for (none,
        or it failed or was cancelled: roll back the job as it is). After
        :data:`AFTER_EVICT_TIMEOUT_S` without the job back, the rollback fails."""
        evict_id = RollbackPlan.of(row.plan).after_evict
        if evict_id is None:
            return "go", None
        a = m.actions.c
        evict = ctx.conn.execute(
            select(a.state, a.plan, a.finished_at, a.node).where(a.id == evict_id)
        ).first()
        if evict is None or evict.state in ("failed", "cancelled"):
            return "go", None
        if evict.state != "done":
            return "wait", None
        evicted_at = EvictPlan.of(evict.plan).evicted_at or evict.finished_at
        t, s, k = m.attempts.c, m.attempt_sessions.c, m.ranks.c
        attempt = ctx.conn.execute(
            select(t.number, t.world_size)
            .where(t.run_id == row.run_id, t.started_at > evicted_at)
            .order_by(t.number.desc())
            .limit(1)
        ).first()
        if attempt is not None:
            back = ctx.conn.execute(
                select(s.rank)
                .join(m.ranks, (k.run_id == s.run_id) & (k.session == s.session))
                .where(
                    s.run_id == row.run_id,
                    s.attempt == attempt.number,
                    s.ended_at.is_(None),
                    s.first_step.is_not(None),
                    k.state.in_(LIVE_RANKS),
                )
            ).scalars()
            ranks = sorted(set(back))
            if ranks and len(ranks) >= (attempt.world_size or 0):
                return "go", ranks
        if ctx.now - (evict.finished_at or evicted_at) > AFTER_EVICT_TIMEOUT_S:
            self._finish(
                ctx,
                row,
                "failed",
                reason=f"the job did not come back within {AFTER_EVICT_TIMEOUT_S:.0f} s of "
                f"evicting {evict.node}: restore a clean checkpoint by hand "
                "(GET /api/v1/runs/{run}/checkpoints marks them)",
            )
            return "wait", None
        return "wait", None

    def _executing_rollback(self, ctx: Ctx, row: Any) -> None:
        pol = self.policy.rollback
        plan = RollbackPlan.of(row.plan)
        if plan.has("restored_at"):
            self._verify_rollback(ctx, row, plan)
            return
        assert plan.prepared_at is not None and plan.ranks is not None and plan.rollback
        acks = rank_acks(ctx.conn, row, since=plan.prepared_at, phase="prepare")
        ranks = plan.ranks
        if not plan.has("committed_at"):
            prepared = {
                r: acks[r] for r in ranks if r in acks and acks[r].get("phase") == "prepare"
            }
            refused = {r: a for r, a in prepared.items() if not a.get("armed")}
            refused |= {
                r: {**a, "error": "stopped holding: no decision within its wait"}
                for r, a in acks.items()
                if r in ranks and a.get("phase") == "timeout"
            }
            # A rank whose process ended (the job finished, it died) will never hold: say
            # so now, not after the prepare's timeout and its retries.
            ended = gone_ranks(ctx.conn, row.run_id, [r for r in ranks if r not in prepared])
            refused |= {r: {"error": ENDED_BEFORE_HOLDING} for r in ended}
            if refused or ctx.now - plan.prepared_at > pol.prepare_timeout.value:
                why = (
                    "; ".join(f"rank {r}: {a.get('error')}" for r, a in sorted(refused.items()))
                    or f"ranks {sorted(set(ranks) - set(prepared))} did not answer within "
                    f"{pol.prepare_timeout}"
                )
                fatal = bool(ended) or any(
                    "on_rollback" in str(a.get("error")) for a in refused.values()
                )
                attempt = plan.attempt or 1
                tries = attempt - (plan.round_start or 1) + 1  # of this restore
                if tries >= pol.attempts or fatal:
                    self._finish(ctx, row, "failed", reason=f"ranks not ready: {why}")
                    # After _finish closed the action's other commands: this one must go out,
                    # or an armed rank holds at the barrier until its decision timeout.
                    # _close_commands closes it once the ranks have had time to take it.
                    abort = {
                        "type": "rollback",
                        "phase": "abort",
                        "action": row.id,
                        "attempt": attempt,
                    }
                    queue_commands(ctx.conn, row, ranks, abort, ctx.now)
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
                        "attempt": attempt,
                    }
                    queue_commands(ctx.conn, row, ranks, abort, ctx.now)
                    self._set(
                        ctx,
                        row,
                        "approved",
                        detail=f"aborted attempt {attempt}: {why}",
                        plan=plan.carried(),
                    )
                return
            if len(prepared) == len(ranks):
                # Each rank holds at most one step past the step it answered with: none can
                # be past the newest + 1, and in lockstep none is more than one step short.
                answered = {r: int(a.get("step") or 0) for r, a in prepared.items()}
                barrier = max(answered.values()) + 1
                skip_to = (
                    plan.rollback.skip_to  # the data is replayed as it was
                    if plan.keep_data
                    else barrier + pol.skip_margin_steps
                )
                commit = {
                    "type": "rollback",
                    "phase": "commit",
                    "action": row.id,
                    "attempt": plan.attempt,
                    "barrier_step": barrier,
                    "skip_to": skip_to,
                }
                queue_commands(ctx.conn, row, ranks, commit, ctx.now)
                plan.committed_at = ctx.now
                plan.barrier_step = barrier
                plan.answered_at_step = min(answered.values())
                plan.rollback.skip_to = skip_to
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
        # A rank that ended before restoring never will (the job finished meanwhile).
        ended = gone_ranks(ctx.conn, row.run_id, [r for r in ranks if r not in done])
        failed |= {r: {"error": ENDED_BEFORE_RESTORING} for r in ended}
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
                        for k in ("barrier_step", "checkpoint_step", "seconds", "at", "ts")
                    }
                    for r in ranks
                },
                "restored_within_s": round(
                    max(a["at"] for a in done.values()) - (plan.committed_at or 0.0), 3
                ),
                "since_prepare_s": round(max(a["at"] for a in done.values()) - plan.prepared_at, 3),
                # steps run from the command reaching the ranks to the restore
                "steps_after_command": (plan.barrier_step or 0) - (plan.answered_at_step or 0),
                "steps_after_issue": (plan.barrier_step or 0) - (plan.issued_at_step or 0),
            }
            if plan.restores:
                result["restores"] = [r.dump() for r in plan.restores]
            rule = self._rule_of(ctx, row)
            if rule is None or pol.verify_steps == 0 or not checkable(rule):
                self._finish(ctx, row, "done", result=result)
                return
            step = plan.rollback.checkpoint_step
            plan.restored_at = ctx.now
            plan.result = result
            plan.rule = rule.name
            plan.restored_ts = min(float(a.get("ts") or ctx.now) for a in done.values())
            self._set(
                ctx,
                row,
                "executing",
                detail=f"every rank restored the checkpoint of step {step}; "
                f"checking {rule.name} on the steps run again",
                plan=plan,
            )
        elif ctx.now - (plan.committed_at or ctx.now) > pol.apply_timeout.value:
            self._finish(
                ctx,
                row,
                "failed",
                reason=f"ranks {sorted(set(ranks) - set(done))} did not restore within "
                f"{pol.apply_timeout}",
            )

    def _rule_of(self, ctx: Ctx, row: Any) -> Rule | None:
        if row.alert_id is None:
            return None  # an operator's rollback: no rule to ask
        name = ctx.conn.execute(
            select(m.alerts.c.rule).where(m.alerts.c.id == row.alert_id)
        ).scalar()
        return self.rules.get(name) if name is not None else None

    def _verify_rollback(self, ctx: Ctx, row: Any, plan: RollbackPlan) -> None:
        """Every rank restored: done once the alert's rule no longer holds on the steps
        run again; if it still does, the checkpoint was bad too, and the rollback goes
        again to an older clean one (:meth:`_start_rollback` keeps the budget)."""
        pol = self.policy.rollback
        assert plan.rollback is not None and plan.ranks is not None
        assert plan.restored_ts is not None and plan.restored_at is not None
        rule = self.rules.get(plan.rule or "")
        result = dict(plan.result or {})
        step = plan.rollback.checkpoint_step
        if rule is None:
            self._finish(
                ctx,
                row,
                "done",
                result={**result, "check": f"not checked: rule {plan.rule} is no longer loaded"},
            )
            return
        check = check_replay(
            ctx.conn,
            rule=rule,
            run_id=row.run_id,
            ranks=plan.ranks,
            checkpoint_step=step,
            since_ts=plan.restored_ts,
            need=steps_needed(rule, pol.verify_steps),
            now=ctx.now,
        )
        if not check.ready:
            gone = gone_ranks(ctx.conn, row.run_id, plan.ranks)
            restart = restarted_since(ctx.conn, row.run_id, plan.restored_ts)
            if gone or restart or ctx.now - plan.restored_at > pol.verify_timeout.value:
                why = (
                    f"ranks {sorted(gone)} ended"
                    if gone
                    else f"the job restarted (attempt {restart}): the processes that restored "
                    "are gone"
                    if restart
                    else f"waited {pol.verify_timeout}"
                )
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
            *(plan.restores or []),
            Restore(checkpoint_step=step, steps=list(check.steps or ()), detail=check.detail),
        ]
        # Decisions are per attempt: the commands of this one are over.
        ctx.conn.execute(
            update(m.agent_commands)
            .where(m.agent_commands.c.action_id == row.id)
            .values(done_at=ctx.now)
        )
        again = plan.carried()
        again.restores = restores
        again.below_step = step
        again.round_start = (plan.attempt or 1) + 1
        self._set(
            ctx,
            row,
            "approved",
            detail=f"{not_fixed(restores[-1])}; rolling back to an older checkpoint",
            plan=again,
        )


WAITING = "waiting for ranks"


def _approved_at(row: Any, now: float) -> float:
    """When the action was last approved (its history, not counting the notes of its wait
    for ranks), else ``now``."""
    return next(
        (
            float(h["at"])
            for h in reversed(row.history or [])
            if h.get("state") == "approved" and not str(h.get("detail") or "").startswith(WAITING)
        ),
        now,
    )
