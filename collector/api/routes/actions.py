"""HTTP routes for actions: list them with their history, ask for one (an operator's
rollback, eviction or stop), approve or cancel one; and a run's checkpoints."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, Query

from trainwarden.collector.actions import service
from trainwarden.collector.actions.schemas import ActionIn, ActionOut, ByIn, CheckpointOut, State
from trainwarden.collector.api import auth
from trainwarden.collector.api.deps import EngineDep, PolicyDep, admin
from trainwarden.collector.ingest.schema_checks import RowId
from trainwarden.collector.store.db import write

router = APIRouter(prefix="/api/v1/actions", tags=["actions"])
of_runs = APIRouter(prefix="/api/v1/runs/{run}", tags=["actions"])


@router.get("", response_model=list[ActionOut])
def list_actions(
    engine: EngineDep,
    run: str | None = None,
    state: Annotated[list[State] | None, Query()] = None,
    kind: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 500,
) -> list[ActionOut]:
    """Actions, newest first, each with its plan, result and history."""
    with engine.connect() as conn:
        return service.list_actions(conn, run=run, states=state, kind=kind, limit=limit)


@router.get("/{action_id}", response_model=ActionOut)
def get_action(action_id: RowId, engine: EngineDep) -> ActionOut:
    """One action with the commands it sent to ranks (and when they were delivered)."""
    with engine.connect() as conn:
        return service.get_action(conn, action_id=action_id)


@of_runs.get("/checkpoints", response_model=list[CheckpointOut])
def list_checkpoints(run: str, engine: EngineDep, policy: PolicyDep) -> list[CheckpointOut]:
    """The run's checkpoints (reported by ``tw.checkpoint_saved``), oldest first: good, or
    suspect because they were saved after the onset of an anomaly that rolls back."""
    with engine.connect() as conn:
        return service.list_checkpoints(conn, run=run, policy=policy)


@of_runs.post("/actions", response_model=ActionOut, status_code=201, dependencies=[admin])
def request_action(run: str, body: ActionIn, engine: EngineDep, policy: PolicyDep) -> ActionOut:
    """An operator asks for a rollback, an eviction or a stop: it is approved by the
    asking (unless the policy or ``dry_run`` says dry-run) and runs like any other."""
    by = auth.acting(body.by, limit=128 - len("operator:"))
    with write(engine) as conn:
        return service.request_action(
            conn, policy=policy, run=run, body=body, by=by, now=time.time()
        )


@router.post("/{action_id}/approve", response_model=ActionOut, dependencies=[admin])
def approve_action(action_id: RowId, body: ByIn, engine: EngineDep) -> ActionOut:
    """Approve a proposed action (policy ``require-ack``)."""
    with write(engine) as conn:
        return service.decide(
            conn,
            action_id=action_id,
            state="approved",
            by=auth.acting(body.by),
            reason=body.reason,
            now=time.time(),
        )


@router.post("/{action_id}/cancel", response_model=ActionOut, dependencies=[admin])
def cancel_action(action_id: RowId, body: ByIn, engine: EngineDep) -> ActionOut:
    """Cancel an action that has not started executing."""
    with write(engine) as conn:
        return service.decide(
            conn,
            action_id=action_id,
            state="cancelled",
            by=auth.acting(body.by),
            reason=body.reason,
            now=time.time(),
        )
