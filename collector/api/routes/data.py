"""HTTP route for a run's data integrity: epoch coverage, the data mixture, data events."""

from __future__ import annotations

from fastapi import APIRouter

from trainwarden.collector.api.deps import EngineDep
from trainwarden.collector.read import data
from trainwarden.collector.read.data import RunData

router = APIRouter(prefix="/api/v1/runs/{run}", tags=["runs"])


@router.get("/data", response_model=RunData)
def get_data(run: str, engine: EngineDep) -> RunData:
    """What the run trained on: each judged epoch's coverage (samples trained on, more
    than once, never; flagged where a ``data_duplicated`` or ``data_skipped`` warning was
    raised), each source's share of the newest steps' tokens against the declared mixture
    (``tw.init(data_mixture=...)``), and the newest data events (``duplicate_batch``,
    ``data_order_drift``, ``data_duplicated``, ``data_skipped``, ``data_mixture_drift``)."""
    with engine.connect() as conn:
        return data.view(conn, run=run)
