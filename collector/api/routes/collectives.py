"""HTTP routes for a hung run's collectives: the verdict on the ranks' Flight Recorder
rings, and an operator's request that every rank send its ring now."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from trainwarden.collector.api import auth
from trainwarden.collector.api.deps import EngineDep, admin
from trainwarden.collector.health import hang
from trainwarden.collector.health.schemas import CollectivesAsked, CollectivesOut
from trainwarden.collector.store.db import write

router = APIRouter(prefix="/api/v1/runs/{run}", tags=["runs"])


@router.get("/collectives", response_model=CollectivesOut)
def get_collectives(run: str, engine: EngineDep) -> CollectivesOut:
    """Which rank never arrived, in which collective, on which process group: each rank's
    newest ring (sent when a rank hung, or asked for) and the verdict on them."""
    with engine.connect() as conn:
        return CollectivesOut(**hang.view(conn, run=run, now=time.time()))


@router.post("/collectives", response_model=CollectivesAsked, status_code=202, dependencies=[admin])
def request_collectives(run: str, engine: EngineDep, request: Request) -> CollectivesAsked:
    """Ask every rank of the run for its Flight Recorder ring now (their next ingest
    answer carries the request; they answer from their exporter thread)."""
    with write(engine) as conn:
        asked = hang.request(
            conn,
            run=run,
            by=auth.acting("operator"),
            now=time.time(),
            reason="an operator asked",
            board=getattr(request.app.state, "commands", None),
        )
    return CollectivesAsked(**asked)
