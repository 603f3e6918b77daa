"""Operational routes: ``/healthz`` (liveness and database reachability) and
``/metrics`` (Prometheus)."""

from __future__ import annotations

import os

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text

from trainwarden.collector.api.deps import EngineDep, MetricsDep

RETRY_AFTER_S = "5"

router = APIRouter(tags=["ops"])


@router.get("/healthz")
def healthz(engine: EngineDep, response: Response) -> dict[str, str | int]:
    """Liveness and database reachability, and which collector process answered (``pid``:
    with ``serve --workers N``, one of N)."""
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception:
        response.status_code = 503
        response.headers["Retry-After"] = RETRY_AFTER_S
        return {"status": "degraded", "database": "unreachable", "pid": os.getpid()}
    return {"status": "ok", "database": "ok", "pid": os.getpid()}


@router.get("/metrics", response_class=Response)
def metrics(collector: MetricsDep) -> Response:
    """Prometheus metrics."""
    return Response(collector.exposition(), media_type=CONTENT_TYPE_LATEST)
