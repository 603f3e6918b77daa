"""Actions as operators see and ask for them: list and read them, an operator's own
rollback, eviction or stop, approving and cancelling, and a run's checkpoints. The API's
routes and the web UI call these (refusals are ``store.errors``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select, update

from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.records import (
    action_event,
    create_action,
    history_with,
    store_events,
)
from trainwarden.collector.actions.rollback import checkpoints
from trainwarden.collector.actions.schemas import ActionIn, ActionOut, CheckpointOut
from trainwarden.collector.read.queries import run_id_of
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import RollbackPlan
from trainwarden.collector.store.errors import Conflict, Invalid, NotFound


def _select() -> Any:
    return select(m.actions, m.runs.c.name.label("run_name")).join(
        m.runs, m.runs.c.id == m.actions.c.run_id
    )


def _out(row: Any, commands: list[dict[str, Any]] | None = None) -> ActionOut:
    return ActionOut(
        id=row.id,
        run=row.run_name,
        kind=row.kind,
        state=row.state,
        mode=row.mode,
        trigger=row.trigger,
        alert_id=row.alert_id,
        rank=row.rank,
        node=row.node,
        approver=row.approver,
        plan=row.plan,
        result=row.result,
        reason=row.reason,
        history=row.history or [],
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=row.finished_at,
        commands=commands,
    )


def _get(conn: Connection, action_id: int) -> Any:
    row = conn.execute(_select().where(m.actions.c.id == action_id)).first()
    if row is None:
        raise NotFound(f"action {action_id} not found")
    return row


def list_actions(
    conn: Connection,
    *,
    run: str | None = None,
    states: Sequence[str] | None = None,
    kind: str | None = None,
    limit: int = 500,
) -> list[ActionOut]:
    """Actions, newest first, each with its plan, result and history."""
    a = m.actions.c
    query = _select()
    if run is not None:
        query = query.where(m.runs.c.name == run)
    if states:
        query = query.where(a.state.in_(list(states)))
    if kind is not None:
        query = query.where(a.kind == kind)
    return [_out(r) for r in conn.execute(query.order_by(a.id.desc()).limit(limit))]


def get_action(conn: Connection, *, action_id: int) -> ActionOut:
    """One action with the commands it sent to ranks (and when they were delivered)."""
    c = m.agent_commands.c
    row = _get(conn, action_id)
    commands = [
        {
            "id": r.id,
            "rank": r.rank,
            **r.body,
            "created_at": r.created_at,
            "delivered_at": r.delivered_at,
            "done_at": r.done_at,
        }
        for r in conn.execute(
            select(m.agent_commands).where(c.action_id == action_id).order_by(c.id)
        )
    ]
    return _out(row, commands)


def list_checkpoints(conn: Connection, *, run: str, policy: ActionPolicy) -> list[CheckpointOut]:
    """The run's checkpoints, oldest first, good or suspect (``rollback.checkpoints``)."""
    found = checkpoints(conn, run_id_of(conn, run), margin_steps=policy.rollback.margin_steps)
    return [CheckpointOut(**c) for c in found]


def request_action(
    conn: Connection, *, policy: ActionPolicy, run: str, body: ActionIn, by: str, now: float
) -> ActionOut:
    """An operator's rollback, eviction or stop: approved by the asking (``by``), unless
    the policy or ``body.dry_run`` says dry-run."""
    run_id = run_id_of(conn, run)
    k = m.ranks.c
    if body.kind == "evict":
        known = conn.execute(select(k.rank).where(k.run_id == run_id, k.node == body.node)).first()
        if known is None:
            raise Invalid(f"node: no rank of run {run!r} runs on node {body.node!r}")
    if body.rank is not None:  # a stop sent to no rank would wait for its answer forever
        known = conn.execute(select(k.rank).where(k.run_id == run_id, k.rank == body.rank)).first()
        if known is None:
            raise Invalid(f"rank: run {run!r} has no rank {body.rank}")
    mode = "dry-run" if body.dry_run or policy.of(body.kind).mode == "dry-run" else "auto"
    action_id = create_action(
        conn,
        policy,
        run_id=run_id,
        kind=body.kind,
        now=now,
        trigger=f"operator:{by}",
        node=body.node,
        rank=body.rank,
        detail=body.reason,
        mode=mode,
        approver=by,
        plan=RollbackPlan(checkpoint_step=body.checkpoint_step)
        if body.checkpoint_step is not None
        else None,
    )
    return _out(_get(conn, action_id))


def decide(
    conn: Connection, *, action_id: int, state: str, by: str, reason: str, now: float
) -> ActionOut:
    """Approve (``state`` approved) a proposed action, or cancel one not yet executing."""
    row = _get(conn, action_id)
    allowed = ("proposed",) if state == "approved" else ("proposed", "approved")
    if row.state not in allowed:
        raise Conflict(
            f"action {action_id} is {row.state}; only a {' or '.join(allowed)} one can be {state}"
        )
    values: dict[str, Any] = {
        "state": state,
        "updated_at": now,
        "history": history_with(row, state, by, reason or None, now),
    }
    if state == "approved":
        values["approver"] = by
    else:
        values.update(finished_at=now, reason=reason or f"cancelled by {by}")
    conn.execute(update(m.actions).where(m.actions.c.id == action_id).values(**values))
    detail = f"{state} by {by}" + (f": {reason}" if reason else "")
    store_events(conn, [action_event(row, state, detail, now)], now)  # for the run's timeline
    return _out(_get(conn, action_id))
