"""HTTP routes for the nodes' records across runs: the findings that implicated each
node, and marking one repaired (``collector/read/nodes.py``)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from trainwarden.collector.api import auth
from trainwarden.collector.api.deps import EngineDep, admin
from trainwarden.collector.read import nodes as svc
from trainwarden.collector.store.db import write

router = APIRouter(prefix="/api/v1/nodes", tags=["nodes"])
NodeName = Annotated[str, Path(min_length=1, max_length=255, description="The node's name")]


class ClearIn(BaseModel):
    """Mark a node repaired: its findings so far no longer count against it."""

    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128, description="Who clears it")
    note: str = Field(min_length=1, max_length=2000, description="What was repaired")


@router.get("")
def list_nodes(
    engine: EngineDep,
    days: Annotated[float, Query(gt=0, le=3650, description="The window, in days")] = 7.0,
) -> list[dict[str, Any]]:
    """Each node with findings in the last ``days`` that still count (not cleared): how
    many, in how many runs, by kind, and when; most runs first."""
    with engine.connect() as conn:
        return svc.nodes(conn, now=time.time(), days=days)


@router.get("/{node}")
def get_node(
    node: NodeName,
    engine: EngineDep,
    days: Annotated[float, Query(gt=0, le=3650, description="The window, in days")] = 90.0,
) -> dict[str, Any]:
    """One node's findings across runs in the last ``days`` (oldest first; each with its
    run, rank and step, and ``cleared`` when the node was marked repaired after it) and
    its clearances."""
    with engine.connect() as conn:
        return svc.record(conn, node, now=time.time(), days=days)


@router.post("/{node}/clear", status_code=201, dependencies=[admin])
def clear_node(node: NodeName, body: ClearIn, engine: EngineDep) -> dict[str, Any]:
    """Mark the node repaired (admin): its findings so far stay on its record but no
    longer count (``GET /api/v1/nodes``, ``trainwarden nodes exclude``)."""
    with write(engine) as conn:
        return svc.clear(conn, node, by=auth.acting(body.by), note=body.note, now=time.time())
