"""HTTP routes for run identity (attempts, config / code / environment, diff) and run
economics (checkpoints, goodput, the checkpoint cadence advisor)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import Engine

from trainwarden.collector.read import economics as svc
from trainwarden.collector.read import identity as runs_identity
from trainwarden.collector.read.queries import NotFound
from trainwarden.collector.read.queries import run_id_of as _run_id

router = APIRouter(tags=["runs"])

AttemptNumber = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="default: the newest")]


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def settings_of_app(s: Any) -> svc.EconomicsSettings:
    """The economics part of serve's :class:`~trainwarden.collector.settings.Settings`."""
    return svc.EconomicsSettings(
        price_per_gpu_hour=s.price_per_gpu_hour,
        mtbf_hours=s.mtbf_hours,
        gpu_mtbf_hours=s.gpu_mtbf_hours,
    )


def settings_of(request: Request) -> svc.EconomicsSettings:
    return settings_of_app(request.app.state.settings)


@router.get("/api/v1/runs/{run}/attempts")
def list_attempts(run: str, request: Request) -> list[dict[str, Any]]:
    """Every process lifetime of the run, oldest first: start, end, exit reason, world
    size, nodes, first and last step, and each rank's process and how it ended."""
    with _engine(request).connect() as conn:
        return runs_identity.attempts(conn, _run_id(conn, run))


@router.get("/api/v1/runs/{run}/identity")
def run_identity(run: str, request: Request, attempt: AttemptNumber = None) -> dict[str, Any]:
    """What the run is: the config, tags and data snapshot given to ``tw.init``, the code
    version, and the environment of its newest attempt (or of ``attempt``)."""
    with _engine(request).connect() as conn:
        found = runs_identity.identity(conn, _run_id(conn, run), attempt)
    if found is None:
        raise NotFound(
            f"run {run!r} has no identity{'' if attempt is None else f' for attempt {attempt}'}: "
            "its agents sent no attempt_start (trainwarden < 0.11?)"
        )
    return found


@router.get("/api/v1/runs/{run}/packages")
def run_packages(run: str, request: Request, attempt: AttemptNumber = None) -> list[str]:
    """The installed Python packages (``name==version``) rank 0 reported."""
    with _engine(request).connect() as conn:
        found = runs_identity.packages(conn, _run_id(conn, run), attempt)
    if found is None:
        raise NotFound(f"run {run!r} reported no package list")
    return found


@router.get("/api/v1/runs/{a}/diff/{b}")
def run_diff(a: str, b: str, request: Request) -> dict[str, Any]:
    """What differs between two runs: config keys (dotted), code version, environment,
    tags, data snapshot, world size and installed packages."""
    with _engine(request).connect() as conn:
        return {"a": a, "b": b, **runs_identity.diff(conn, _run_id(conn, a), _run_id(conn, b))}


@router.get("/api/v1/runs/{run}/economics")
def run_economics(run: str, request: Request) -> dict[str, Any]:
    """Checkpoints (count, last, interval, blocking cost C, bytes), goodput (ETTR and where
    the rest of the allocation went, GPU-hours, cost) and the cadence advisor (T* =
    sqrt(2 C tau), expected waste now and at T*)."""
    with _engine(request).connect() as conn:
        found = svc.economics(conn, run, settings=settings_of(request))
    if found is None:
        raise NotFound(f"run {run!r} not found")
    return found
