"""HTTP routes for actions: list them with their history, ask for one (an operator's
rollback, eviction or stop), approve or cancel one."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import Connection, Engine, select, update

from trainwarden.collector.actions.policy import ActionPolicy
from trainwarden.collector.actions.records import _event, _history, _store_events, create_action
from trainwarden.collector.actions.rollback import checkpoints
from trainwarden.collector.api import auth
from trainwarden.collector.ingest.schemas import RowId
from trainwarden.collector.read.queries import NotFound, run_id_of
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

router = APIRouter(tags=["actions"])
State = Literal["proposed", "approved", "executing", "done", "failed", "cancelled"]


class ActionOut(BaseModel):
    id: int
    run: str
    kind: str
    state: State
    mode: str
    trigger: str
    alert_id: int | None
    rank: int | None
    node: str | None
    approver: str | None
    plan: dict[str, Any] | None
    result: dict[str, Any] | None
    reason: str | None
    history: list[dict[str, Any]]
    created_at: float
    updated_at: float
    finished_at: float | None
    commands: list[dict[str, Any]] | None = None


class ActionIn(BaseModel):
    """An operator's action on a run."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["rollback", "evict", "stop"]
    by: str = Field(min_length=1, max_length=128, description="Who asks (kept in the audit trail)")
    reason: str = Field(min_length=1, max_length=1000)
    checkpoint_step: int | None = Field(default=None, ge=0, description="rollback: this checkpoint")
    node: str | None = Field(
        default=None, min_length=1, max_length=255, description="evict: this node"
    )
    rank: int | None = Field(default=None, ge=0, description="stop: only this rank")
    dry_run: bool = False

    @model_validator(mode="after")
    def _fits(self) -> ActionIn:
        if self.kind == "evict" and self.node is None:
            raise ValueError("an eviction names its node")
        if self.kind != "evict" and self.node is not None:
            raise ValueError(f"node is for evictions, not a {self.kind}")
        if self.kind != "rollback" and self.checkpoint_step is not None:
            raise ValueError(f"checkpoint_step is for rollbacks, not a {self.kind}")
        return self


class ByIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128)
    reason: str = Field(default="", max_length=1000)


def _engine(request: Request) -> Engine:
    return request.app.state.engine


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


@router.get("/api/v1/actions", response_model=list[ActionOut])
def list_actions(
    request: Request,
    run: str | None = None,
    state: Annotated[list[State] | None, Query()] = None,
    kind: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> list[ActionOut]:
    """Actions, newest first, each with its plan, result and history."""
    a = m.actions.c
    query = _select()
    if run is not None:
        query = query.where(m.runs.c.name == run)
    if state:
        query = query.where(a.state.in_(state))
    if kind is not None:
        query = query.where(a.kind == kind)
    with _engine(request).connect() as conn:
        return [_out(r) for r in conn.execute(query.order_by(a.id.desc()).limit(limit))]


@router.get("/api/v1/actions/{action_id}", response_model=ActionOut)
def get_action(action_id: RowId, request: Request) -> ActionOut:
    """One action with the commands it sent to ranks (and when they were delivered)."""
    c = m.agent_commands.c
    with _engine(request).connect() as conn:
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


class CheckpointOut(BaseModel):
    step: int
    path: str | None
    ts: float
    rank: int | None
    meta: dict[str, Any]
    good: bool
    suspect: str | None = Field(description="why it is not good: saved before an anomaly cleared")


@router.get("/api/v1/runs/{run}/checkpoints", response_model=list[CheckpointOut])
def list_checkpoints(run: str, request: Request) -> list[CheckpointOut]:
    """The run's checkpoints (reported by ``tw.checkpoint_saved``), oldest first: good, or
    suspect because they were saved after the onset of an anomaly that rolls back."""
    policy: ActionPolicy = request.app.state.action_policy
    with _engine(request).connect() as conn:
        found = checkpoints(conn, run_id_of(conn, run), margin_steps=policy.rollback.margin_steps)
        return [CheckpointOut(**c) for c in found]


@router.post("/api/v1/runs/{run}/actions", response_model=ActionOut, status_code=201)
def request_action(run: str, body: ActionIn, request: Request) -> ActionOut:
    """An operator asks for a rollback, an eviction or a stop: it is approved by the
    asking (unless the policy or ``dry_run`` says dry-run) and runs like any other."""
    auth.check_admin()  # the UI calls this function in-process
    policy: ActionPolicy = request.app.state.action_policy
    now = time.time()
    with write(_engine(request)) as conn:
        run_id = run_id_of(conn, run)
        if body.kind == "evict":
            known = conn.execute(
                select(m.ranks.c.rank).where(
                    m.ranks.c.run_id == run_id, m.ranks.c.node == body.node
                )
            ).first()
            if known is None:
                raise HTTPException(422, f"node: no rank of run {run!r} runs on node {body.node!r}")
        if body.rank is not None:  # a stop sent to no rank would wait for its answer forever
            known = conn.execute(
                select(m.ranks.c.rank).where(
                    m.ranks.c.run_id == run_id, m.ranks.c.rank == body.rank
                )
            ).first()
            if known is None:
                raise HTTPException(422, f"rank: run {run!r} has no rank {body.rank}")
        mode = "dry-run" if body.dry_run or policy.of(body.kind).mode == "dry-run" else "auto"
        by = auth.acting(body.by, limit=128 - len("operator:"))
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
            plan={"checkpoint_step": body.checkpoint_step}
            if body.checkpoint_step is not None
            else None,
        )
        return _out(_get(conn, action_id))


@router.post("/api/v1/actions/{action_id}/approve", response_model=ActionOut)
def approve_action(action_id: RowId, body: ByIn, request: Request) -> ActionOut:
    """Approve a proposed action (policy ``require-ack``)."""
    auth.check_admin()  # the UI calls this function in-process
    return _decide(request, action_id, body, "approved")


@router.post("/api/v1/actions/{action_id}/cancel", response_model=ActionOut)
def cancel_action(action_id: RowId, body: ByIn, request: Request) -> ActionOut:
    """Cancel an action that has not started executing."""
    auth.check_admin()  # the UI calls this function in-process
    return _decide(request, action_id, body, "cancelled")


def _decide(request: Request, action_id: int, body: ByIn, state: str) -> ActionOut:
    now = time.time()
    by = auth.acting(body.by)
    with write(_engine(request)) as conn:
        row = _get(conn, action_id)
        allowed = ("proposed",) if state == "approved" else ("proposed", "approved")
        if row.state not in allowed:
            raise HTTPException(
                409,
                f"action {action_id} is {row.state}; only a {' or '.join(allowed)} one can be {state}",
            )
        values: dict[str, Any] = {
            "state": state,
            "updated_at": now,
            "history": _history(row, state, by, body.reason or None, now),
        }
        if state == "approved":
            values["approver"] = by
        else:
            values.update(finished_at=now, reason=body.reason or f"cancelled by {by}")
        conn.execute(update(m.actions).where(m.actions.c.id == action_id).values(**values))
        detail = f"{state} by {by}" + (f": {body.reason}" if body.reason else "")
        _store_events(conn, [_event(row, state, detail, now)], now)  # for the run's timeline
        return _out(_get(conn, action_id))
