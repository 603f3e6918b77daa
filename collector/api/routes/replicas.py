"""HTTP route for a run's replica comparisons (silent data corruption checks)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from trainwarden.collector.api.deps import EngineDep
from trainwarden.collector.read import replicas
from trainwarden.collector.read.schemas import ReplicaResult

router = APIRouter(prefix="/api/v1/runs/{run}", tags=["runs"])


@router.get("/replicas", response_model=list[ReplicaResult])
def list_replicas(
    run: str, engine: EngineDep, last: Annotated[int, Query(ge=1, le=10_000)] = 200
) -> list[ReplicaResult]:
    """Each checked step's comparison of the replicas' parameter fingerprints, per replica
    group, oldest first: agreed, or the suspects (``replica_divergence`` events name
    them and where they diverged), and the members that sent none."""
    with engine.connect() as conn:
        return [ReplicaResult(**r) for r in replicas.results(conn, run=run, last=last)]
