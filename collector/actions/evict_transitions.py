"""The transitions of an eviction (through the scheduler backend, then a stop to the node's
ranks) and of a stop (every rank, or one, exits with ``STOPPED_EXIT_CODE``).

A stop of the whole run is two-phase, as a rollback is (``trainwarden.agent.commands``):
*prepare* (every rank answers with its last step and holds at its next boundary), then
*commit* naming the barrier ``max(answered) + 1``, after which every rank stops: no rank
is left waiting in a collective for a peer that stopped a step before it. When a rank
does not answer within the stop policy's ``prepare_timeout``, the holders are freed
(*abort*) and every rank gets a plain stop, applied at its next boundary.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import and_, or_, select, update

from trainwarden.collector.actions.evict import Eviction
from trainwarden.collector.actions.records import (
    gone_ranks,
    live_ranks,
    queue_commands,
    rank_acks,
)
from trainwarden.collector.actions.transitions import Ctx, Transitions
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import EvictPlan, StopPlan

STOP_TIMEOUT_S = 60.0
"""A stop is done once every rank acknowledged it or is gone, or after this long."""


def _stop_reason(row: Any) -> str:
    return f"trainwarden: {row.trigger}" + (f" ({row.reason})" if row.reason else "")


class EvictTransitions(Transitions):
    def _start_stop(self, ctx: Ctx, row: Any) -> None:
        ranks = [row.rank] if row.rank is not None else live_ranks(ctx.conn, row.run_id)
        reason = _stop_reason(row)
        if len(ranks) < 2 or row.rank is not None:  # one rank: nobody waits for it
            self._stop_now(ctx, row, ranks, f"stop sent to ranks {ranks}", plan=StopPlan())
            return
        prepare = {"type": "stop", "phase": "prepare", "action": row.id, "attempt": 1}
        queue_commands(ctx.conn, row, ranks, {**prepare, "reason": reason}, ctx.now)
        self._set(
            ctx,
            row,
            "executing",
            detail=f"prepare: ranks {ranks} hold at their next step, to stop after one step",
            plan=StopPlan(ranks=ranks, sent_at=ctx.now, prepared_at=ctx.now),
        )

    def _stop_now(
        self, ctx: Ctx, row: Any, ranks: list[int], detail: str, *, plan: StopPlan
    ) -> None:
        """A plain stop: each rank ends at its next step boundary."""
        stop = {"type": "stop", "action": row.id, "reason": _stop_reason(row)}
        queue_commands(ctx.conn, row, ranks, stop, ctx.now)
        plan.ranks = ranks
        plan.sent_at = ctx.now
        self._set(ctx, row, "executing", detail=detail, plan=plan)

    def _executing_stop(self, ctx: Ctx, row: Any) -> None:
        plan = StopPlan.of(row.plan)
        ranks = plan.ranks or []
        if plan.has("prepared_at") and not plan.has("barrier_step") and not plan.has("plain_at"):
            self._commit_stop(ctx, row)
            return
        assert plan.sent_at is not None
        # a stop at the barrier: since its prepare went out
        since = plan.prepared_at if plan.prepared_at is not None else plan.sent_at
        acks = {
            r: a
            for phase in ("prepare", "commit", "stop")
            for r, a in rank_acks(ctx.conn, row, since=since, phase=phase).items()
            if a.get("stopped")
        }
        gone = gone_ranks(ctx.conn, row.run_id, ranks)
        late = ctx.now - plan.sent_at > STOP_TIMEOUT_S  # a hung rank never hears it
        if late or all(r in acks or r in gone for r in ranks):
            result: dict[str, Any] = {
                "stopped": sorted(acks),
                "already_gone": sorted(set(gone) - set(acks)),
                "no_answer": sorted(set(ranks) - set(acks) - set(gone)),
            }
            if plan.has("barrier_step"):
                result["barrier_step"] = plan.barrier_step
                result["stopped_after"] = {
                    str(r): a.get("barrier_step") for r, a in sorted(acks.items())
                }
            self._finish(ctx, row, "done", result=result)

    def _commit_stop(self, ctx: Ctx, row: Any) -> None:
        """Every rank answered the prepare (or ended): each stops after the barrier step.
        Past the policy's ``prepare_timeout``: free the holders, and stop every rank at once."""
        plan = StopPlan.of(row.plan)
        ranks = plan.ranks or []
        assert plan.prepared_at is not None
        acks = rank_acks(ctx.conn, row, since=plan.prepared_at, phase="prepare")
        held = {r: int(a.get("step") or 0) for r, a in acks.items() if a.get("armed")}
        gone = gone_ranks(ctx.conn, row.run_id, [r for r in ranks if r not in held])
        if not held and all(r in gone for r in ranks):  # nobody left to stop
            self._finish(
                ctx,
                row,
                "done",
                result={"stopped": [], "already_gone": sorted(gone), "no_answer": []},
            )
            return
        if all(r in held or r in gone for r in ranks):
            # Each rank holds at most one step past the step it answered with.
            barrier = max(held.values()) + 1
            commit = {"type": "stop", "phase": "commit", "action": row.id, "attempt": 1}
            queue_commands(
                ctx.conn, row, sorted(held), {**commit, "barrier_step": barrier}, ctx.now
            )
            plan.barrier_step = barrier
            plan.sent_at = ctx.now
            self._set(
                ctx,
                row,
                "executing",
                detail=f"commit: every rank stops after step {barrier}",
                plan=plan,
            )
            return
        if ctx.now - plan.prepared_at > self.policy.stop.prepare_timeout.value:
            silent = sorted(set(ranks) - set(held) - gone)
            ctx.conn.execute(  # the prepare is over: not sent again
                update(m.agent_commands)
                .where(m.agent_commands.c.action_id == row.id)
                .values(done_at=ctx.now)
            )
            abort = {"type": "stop", "phase": "abort", "action": row.id, "attempt": 1}
            queue_commands(ctx.conn, row, sorted(held), abort, ctx.now)
            self._stop_now(
                ctx,
                row,
                ranks,
                f"ranks {silent} did not answer within {self.policy.stop.prepare_timeout}: "
                f"stop sent to ranks {ranks}, each at its next step",
                plan=plan.model_copy(update={"plain_at": ctx.now}),
            )

    def _start_evict(self, ctx: Ctx, row: Any) -> None:
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
                reason=f"blast-radius guard: evicting {row.node} would make "
                f"{len(evicted) + 1} of the run's {len(nodes)} nodes within an hour (limit "
                f"{pol.max_nodes_fraction_per_hour:.0%})",
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
                reason=(
                    f"trainwarden: {row.trigger.removeprefix('rule:')} {row.reason or ''}"
                ).strip(),
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
            plan=EvictPlan(
                node=row.node, ranks=list(ranks), backend=self.backend.name, started_at=ctx.now
            ),
        )

    def _executing_evict(self, ctx: Ctx, row: Any) -> None:
        plan = EvictPlan.of(row.plan)
        if not plan.has("evicted_at"):
            future = self._evictions.get(row.id)
            if future is None:  # the collector restarted while the backend ran: do not run it twice
                self._finish(
                    ctx,
                    row,
                    "failed",
                    reason="interrupted: the collector restarted during the eviction; check "
                    "the node by hand",
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
            plan.evicted_at = ctx.now
            plan.steps = list(result.steps)
            plan.output = str(result.output)[:2000]
            reason = f"node {row.node} evicted by trainwarden ({row.trigger})"
            queue_commands(
                ctx.conn,
                row,
                plan.ranks or [],
                {"type": "stop", "action": row.id, "reason": reason},
                ctx.now,
            )
            self._set(
                ctx,
                row,
                "executing",
                detail=f"{row.node} evicted ({'; '.join(result.steps)}); stopping its ranks "
                f"{plan.ranks}",
                plan=plan,
            )
            return
        assert plan.evicted_at is not None
        ranks = plan.ranks or []
        acks = rank_acks(ctx.conn, row, since=plan.evicted_at, phase="stop")
        gone = gone_ranks(ctx.conn, row.run_id, ranks)
        if all(r in acks or r in gone for r in ranks) or ctx.now - plan.evicted_at > 60:
            result = {
                "node": row.node,
                "steps": plan.steps,
                "drained_within_s": round(plan.evicted_at - row.created_at, 3),
                "ranks_stopped": sorted(acks),
                "ranks_gone": sorted(set(gone) - set(acks)),
            }
            self._finish(ctx, row, "done", result=result)
