"""HTTP routes for run identity (attempts, config / code / environment, diff) and run
economics (checkpoints, goodput, the checkpoint cadence advisor)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from trainwarden.collector.api.deps import EngineDep, SettingsDep
from trainwarden.collector.read import economics, identity

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])

AttemptNumber = Annotated[int | None, Query(ge=1, le=2**31 - 1, description="default: the newest")]


@router.get("/{run}/attempts")
def list_attempts(run: str, engine: EngineDep) -> list[dict[str, Any]]:
    """Every process lifetime of the run, oldest first: start, end, exit reason, world
    size, nodes, first and last step, and each rank's process and how it ended."""
    with engine.connect() as conn:
        return identity.run_attempts(conn, run=run)


@router.get("/{run}/identity")
def run_identity(run: str, engine: EngineDep, attempt: AttemptNumber = None) -> dict[str, Any]:
    """What the run is: the config, tags and data snapshot given to ``tw.init``, the code
    version, and the environment of its newest attempt (or of ``attempt``)."""
    with engine.connect() as conn:
        return identity.run_identity(conn, run=run, attempt=attempt)


@router.get("/{run}/packages")
def run_packages(run: str, engine: EngineDep, attempt: AttemptNumber = None) -> list[str]:
    """The installed Python packages (``name==version``) rank 0 reported."""
    with engine.connect() as conn:
        return identity.run_packages(conn, run=run, attempt=attempt)


@router.get("/{a}/diff/{b}")
def run_diff(a: str, b: str, engine: EngineDep) -> dict[str, Any]:
    """What differs between two runs: config keys (dotted), code version, environment,
    tags, data snapshot, world size and installed packages."""
    with engine.connect() as conn:
        return identity.run_diff(conn, a=a, b=b)


@router.get("/{run}/economics")
def run_economics(run: str, engine: EngineDep, settings: SettingsDep) -> dict[str, Any]:
    """Checkpoints (count, last, interval, blocking cost C, bytes), goodput (ETTR and where
    the rest of the allocation went, GPU-hours, cost) and the cadence advisor (T* =
    sqrt(2 C tau), expected waste now and at T*)."""
    with engine.connect() as conn:
        return economics.run_economics(conn, run=run, settings=economics.settings_of(settings))
