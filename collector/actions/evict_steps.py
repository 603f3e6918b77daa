"""The steps of an eviction (through the scheduler backend, then a stop to the node's
ranks) and of a stop (every rank, or one, exits with ``STOPPED_EXIT_CODE``)."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import and_, or_, select

from trainwarden.collector.actions.evict import Eviction
from trainwarden.collector.actions.records import (
    _acks,
    _commands,
    _gone,
    _live_ranks,
)
from trainwarden.collector.actions.steps import Steps, _Ctx
from trainwarden.collector.store import models as m

STOP_TIMEOUT_S = 60.0
"""A stop is done once every rank acknowledged it or is gone, or after this long."""


class EvictSteps(Steps):
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
                detail=f"{row.node} evicted ({'; '.join(result.steps)}); stopping its ranks "
                f"{plan['ranks']}",
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
