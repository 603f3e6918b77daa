"""What every kind of action's transitions share: a pass's context (``Ctx``) and moving an
action's row from one state to the next (``_set``, ``_finish``), with its history and events."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, update

from trainwarden.alerts.rules import Rule
from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.records import (
    action_event,
    history_with,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import Plan


@dataclass
class Ctx:
    conn: Connection
    now: float
    events: list[dict[str, Any]] = field(default_factory=list)
    evictions: list[tuple[int, Any]] = field(default_factory=list)  # started after the commit


class Transitions:
    """The engine's state that each kind's transitions read (set by ``ActionEngine``)."""

    policy: ActionPolicy
    rules: dict[str, Rule]
    backend: Any
    _evictions: dict[int, Future[Any]]

    def _set(
        self,
        ctx: Ctx,
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
                history=history_with(row, state, by, detail, ctx.now),
                **{k: v.dump() if isinstance(v, Plan) else v for k, v in values.items()},
            )
        )
        ctx.events.append(action_event(row, state, detail, ctx.now))

    def _finish(
        self, ctx: Ctx, row: Any, state: str, *, reason: str | None = None, result: Any = None
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
                    **action_event(row, "failed", reason, ctx.now),
                    "kind": "action_failed",
                    "severity": "critical",
                }
            )
