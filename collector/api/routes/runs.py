"""HTTP routes for runs (``/api/v1/runs``): list and read them, their ranks, events,
series, heatmaps, flagged and replaced steps, GPU readings and preflight results. Thin:
the work is in ``collector.read``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from trainwarden.alerts.metrics import METRICS
from trainwarden.collector.api.deps import EngineDep
from trainwarden.collector.ingest.schema_checks import MAX_RANK, MAX_STEP
from trainwarden.collector.read import preflight, queries, series
from trainwarden.collector.read.schemas import (
    EventOut,
    FlaggedStep,
    GpuSample,
    Heatmap,
    RankInfo,
    RankSeries,
    ReplacedSeries,
    RunDetail,
    RunMetrics,
    RunSummary,
    Series,
)

router = APIRouter(prefix="/api/v1/runs", tags=["runs"])


@router.get("", response_model=list[RunSummary])
def list_runs(
    engine: EngineDep, limit: Annotated[int, Query(ge=1, le=10_000)] = 200
) -> list[RunSummary]:
    """Retrieve runs, most recently updated first."""
    with engine.connect() as conn:
        return queries.list_runs(conn, limit=limit)


@router.get("/{run}", response_model=RunDetail)
def get_run(run: str, engine: EngineDep) -> RunDetail:
    """Retrieve one run with its ranks."""
    with engine.connect() as conn:
        return queries.get_run(conn, run=run)


@router.get("/{run}/metrics", response_model=RunMetrics)
def get_metrics(run: str, engine: EngineDep) -> RunMetrics:
    """Retrieve the series a run has: the built-in metrics and its own (``user.<name>``)."""
    with engine.connect() as conn:
        return RunMetrics(**queries.run_metrics(conn, run=run, builtin=list(METRICS)))


@router.get("/{run}/ranks", response_model=list[RankInfo])
def get_ranks(run: str, engine: EngineDep) -> list[RankInfo]:
    """Retrieve the ranks of a run: host, node, process session, state, last step."""
    with engine.connect() as conn:
        return queries.ranks(conn, run=run)


@router.get("/{run}/events", response_model=list[EventOut])
def get_events(
    run: str,
    engine: EngineDep,
    kind: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> list[EventOut]:
    """Retrieve a run's events (start, shutdown, restart, ...) in time order."""
    with engine.connect() as conn:
        return queries.events(conn, run=run, kind=kind, limit=limit)


@router.get("/{run}/series", response_model=Series)
def get_series(
    run: str,
    engine: EngineDep,
    metric: str,
    from_step: Annotated[int | None, Query(alias="from", ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(alias="to", ge=0, le=MAX_STEP)] = None,
    last: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
    points: Annotated[int | None, Query(ge=10, le=100_000)] = None,
) -> Series:
    """Retrieve one metric per step: min / median / max across ranks and the run total.

    ``points`` downsamples on the server so that spikes survive (min / max per bucket)."""
    with engine.connect() as conn:
        return series.series(
            conn,
            run=run,
            metric=metric,
            from_step=from_step,
            to_step=to_step,
            last=last,
            points=points,
        )


@router.get("/{run}/heatmap", response_model=Heatmap)
def get_heatmap(
    run: str,
    engine: EngineDep,
    metric: str,
    buckets: Annotated[int, Query(ge=1, le=5000)] = 200,
    from_step: Annotated[int | None, Query(alias="from", ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(alias="to", ge=0, le=MAX_STEP)] = None,
) -> Heatmap:
    """Retrieve a rank x step-bucket matrix of a metric (a straggler shows as a stripe)."""
    with engine.connect() as conn:
        return series.heatmap(
            conn, run=run, metric=metric, buckets=buckets, from_step=from_step, to_step=to_step
        )


@router.get("/{run}/ranks/{rank}/series", response_model=RankSeries)
def get_rank_series(
    run: str,
    rank: Annotated[int, Path(ge=0, le=MAX_RANK)],
    engine: EngineDep,
    metric: str,
    from_step: Annotated[int | None, Query(alias="from", ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(alias="to", ge=0, le=MAX_STEP)] = None,
    last: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
) -> RankSeries:
    """Retrieve one metric of one rank per step (e.g. each rank's own loss)."""
    with engine.connect() as conn:
        return series.rank_series(
            conn, run=run, metric=metric, rank=rank, from_step=from_step, to_step=to_step, last=last
        )


@router.get("/{run}/flags", response_model=list[FlaggedStep])
def get_flags(
    run: str, engine: EngineDep, limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000
) -> list[FlaggedStep]:
    """Retrieve the steps on which a rank flagged a spike or a non-finite value."""
    with engine.connect() as conn:
        return queries.flagged_steps(conn, run=run, limit=limit)


@router.get("/{run}/replaced", response_model=ReplacedSeries)
def get_replaced(
    run: str,
    engine: EngineDep,
    metric: Annotated[str, Query(description="loss, grad_norm or step_time")] = "loss",
    from_step: Annotated[int | None, Query(alias="from", ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(alias="to", ge=0, le=MAX_STEP)] = None,
    points: Annotated[int | None, Query(ge=2, le=100_000)] = None,
) -> ReplacedSeries:
    """Retrieve the executions of steps that a rollback or a restart replaced (the series
    keeps the steps run again): the loss spike a rollback went back from, per step across
    ranks; ``points`` downsamples, keeping each bucket's min and max."""
    with engine.connect() as conn:
        return series.replaced_series(
            conn, run=run, metric=metric, points=points, from_step=from_step, to_step=to_step
        )


@router.get("/{run}/gpu", response_model=list[GpuSample])
def get_gpu(
    run: str,
    engine: EngineDep,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK)] = None,
    since: float | None = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> list[GpuSample]:
    """Retrieve NVML readings (temperature, power, clocks, throttle reasons, ECC, ...)."""
    with engine.connect() as conn:
        return queries.gpu_samples(conn, run=run, rank=rank, since=since, limit=limit)


@router.get("/{run}/preflight")
def get_preflight(run: str, engine: EngineDep) -> dict[str, Any]:
    """The newest attempt's preflight (``tw.init(preflight=True)``): each rank's GEMM,
    memory copy and all-reduce rates, NVML facts and faults, its ratios to the median
    rank, and whether it failed (a fault, or under ``outlier`` times the median)."""
    with engine.connect() as conn:
        return preflight.results(conn, run=run)
