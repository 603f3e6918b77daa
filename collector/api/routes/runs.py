"""HTTP routes of ``/api/v1`` plus ``/healthz`` and ``/metrics``. Routes stay thin:
validation is pydantic's, work is in ``ingest`` and ``queries``."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError
from starlette.requests import ClientDisconnect

from trainwarden.alerts.metrics import METRICS
from trainwarden.collector.api import auth
from trainwarden.collector.api.prom import CollectorMetrics
from trainwarden.collector.ingest.schemas import (
    MAX_RANK,
    MAX_STEP,
    ColumnarBatch,
    IngestBatch,
    IngestResult,
)
from trainwarden.collector.ingest.writer import Busy, IngestWriter
from trainwarden.collector.read import queries, series
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
from trainwarden.collector.store.db import write

log = logging.getLogger(__name__)
RETRY_AFTER_S = "5"

router = APIRouter()
BatchT = TypeVar("BatchT", IngestBatch, ColumnarBatch)


def _engine(request: Request) -> Engine:
    return request.app.state.engine


def _metrics(request: Request) -> CollectorMetrics:
    return request.app.state.metrics


def _unavailable(exc: Exception) -> HTTPException:
    log.warning("database unavailable: %s", str(exc).splitlines()[0])
    return HTTPException(
        503, "database unavailable; retry later", headers={"Retry-After": RETRY_AFTER_S}
    )


def _writer(request: Request) -> IngestWriter:
    return request.app.state.writer


def _busy(metrics: CollectorMetrics, why: str, sender: str | None = None) -> HTTPException:
    metrics.busy(sender)
    return HTTPException(
        503, f"collector busy: {why}; retry later", headers={"Retry-After": RETRY_AFTER_S}
    )


def _done(
    request: Request, future: Future[IngestResult] | asyncio.Future[IngestResult], started: float
) -> IngestResult:
    """The outcome of a submitted batch, with its metrics and error mapping."""
    metrics = _metrics(request)
    try:
        result = future.result()
    except ValueError as exc:  # a row the database refused: name it
        metrics.ingest_requests.labels("invalid").inc()
        raise HTTPException(422, str(exc)) from None
    except DBAPIError as exc:
        metrics.ingest_requests.labels("unavailable").inc()
        raise _unavailable(exc) from exc
    metrics.ingest_seconds.observe(time.perf_counter() - started)
    metrics.ingest_ok.inc()
    metrics.ingest_steps.inc(result.accepted_steps)
    if result.accepted_events:
        metrics.ingest_events.inc(result.accepted_events)
    return result


def _sender(batch: IngestBatch | ColumnarBatch) -> str:
    """The batch's run and ranks as the sender header has them: a refused batch is
    still its ranks' heartbeat."""
    ranks = [batch.agent.rank] if isinstance(batch, IngestBatch) else batch.header_columns()["rank"]
    return f"{batch.run}/{','.join(map(str, ranks))}"


RELAY_HINT_WORLD = 256  # a run this large sending a request a rank is told of relays, once


def _hint_relay(request: Request, batch: IngestBatch) -> None:
    """Log once per run (and collector) that a large run's agents send with no relay."""
    if batch.agent.world_size < RELAY_HINT_WORLD:
        return
    hinted = getattr(request.app.state, "relay_hinted", None)
    if hinted is None or len(hinted) > 10_000:
        hinted = request.app.state.relay_hinted = set()
    if batch.run not in hinted:
        hinted.add(batch.run)
        log.warning(
            "run %s: %d ranks, each sending its own requests; one collector takes about "
            "3,500 of those a second on two cores. Run a relay on each node "
            "(TRAINWARDEN_RELAY=auto on the agents, or `trainwarden relay`): one request a node",
            batch.run,
            batch.agent.world_size,
        )


async def submit(request: Request, batch: IngestBatch | ColumnarBatch) -> IngestResult:
    """Hand a validated batch to the group-commit writer and wait for its commit."""
    auth.check_run(batch.run)  # an ingest token may be limited to some runs
    if isinstance(batch, IngestBatch) and "trainwarden-relay" not in request.headers.get("via", ""):
        _hint_relay(
            request, batch
        )  # (a relay sends a batch on its own when the merged one is refused)
    started = time.perf_counter()
    try:
        future = _writer(request).submit_async(batch)
    except Busy as exc:
        raise _busy(_metrics(request), str(exc), _sender(batch)) from None
    with contextlib.suppress(Exception):  # read below
        await future  # the commit
    result = _done(request, future, started)
    board = getattr(request.app.state, "commands", None)
    if board is not None and batch.run in board.runs:
        if isinstance(batch, IngestBatch):
            result.commands = await asyncio.to_thread(_commands_for, request, batch)
        else:  # a relay's node: each rank's commands, for the relay to hand on
            result.rank_commands = await asyncio.to_thread(_rank_commands_for, request, batch)
    if _notable(batch):
        alert_engine = request.app.state.alert_engine
        if alert_engine is not None:
            alert_engine.wake()  # an XID or a NaN pages now, not at the next full pass
    return result


def _commands_for(request: Request, batch: IngestBatch) -> list[dict[str, Any]]:
    """Commands waiting for this rank (a rollback, a stop): they ride on the answer."""
    with write(_engine(request)) as conn:
        return request.app.state.commands.take(conn, batch.run, batch.agent.rank, time.time())


def _rank_commands_for(request: Request, batch: ColumnarBatch) -> dict[int, list[dict[str, Any]]]:
    """The commands waiting for each rank of a columnar batch (its headers' and extras')."""
    ranks = {*batch.header_columns()["rank"], *(extra.agent.rank for extra in batch.extras)}
    board, now = request.app.state.commands, time.time()
    with write(_engine(request)) as conn:
        waiting = {rank: board.take(conn, batch.run, rank, now) for rank in sorted(ranks)}
    return {rank: commands for rank, commands in waiting.items() if commands}


def _notable(batch: IngestBatch | ColumnarBatch) -> bool:
    """Whether the batch holds what event rules watch: events, spike flags, non-finite values."""
    if isinstance(batch, ColumnarBatch):
        return any(batch.steps.get("flags") or ()) or any(map(_notable, batch.extras))
    return bool(batch.events) or any(
        s.flags or (s.loss is not None and not math.isfinite(s.loss)) for s in batch.steps
    )


async def _body(request: Request) -> bytes:
    try:
        return await request.body()
    except ClientDisconnect:  # gone, or cut off by the body limit (which has answered 413)
        raise HTTPException(400, "the client went away before sending the whole body") from None


def _parse(model: type[BatchT], body: bytes) -> BatchT:
    """Parse with orjson, then validate with pydantic; errors read like FastAPI's own."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestValidationError(
            [{"loc": ("body",), "msg": f"body is not valid JSON: {exc}", "type": "json_invalid"}]
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(_in_body(exc)) from None


def _in_body(exc: ValidationError) -> list[dict[str, Any]]:
    """pydantic's errors, located in the body as FastAPI locates its own."""
    return [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI request body of a route that parses its own body."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        EXTRA_SCHEMAS[name] = sub
    EXTRA_SCHEMAS[model.__name__] = schema
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


EXTRA_SCHEMAS: dict[str, Any] = {}
"""Schemas of self-parsed bodies, merged into the OpenAPI document by ``create_app``."""


@router.post(
    "/api/v1/ingest",
    response_model=IngestResult,
    tags=["ingest"],
    openapi_extra=_body_schema(IngestBatch),
)
async def ingest(request: Request) -> IngestResult:
    """Store a batch of one rank's step records, events and GPU samples."""
    return await submit(request, _parse(IngestBatch, await _body(request)))


@router.post(
    "/api/v1/ingest/columns",
    response_model=IngestResult,
    tags=["ingest"],
    openapi_extra=_body_schema(ColumnarBatch),
)
async def ingest_columns(request: Request) -> IngestResult:
    """Store several ranks' steps in one request, column-wise (node relays, loadgen)."""
    return await submit(request, _parse(ColumnarBatch, await _body(request)))


class DirectIngest:
    """Pure ASGI middleware: answers the ingest routes (``routes``: path -> the route's
    own function) itself, past FastAPI's routing, exception, exit-stack and
    response-model layers: one request a node a second is the collector's hottest
    path (a fifth of its CPU a row went to those layers). The routes stay registered,
    for the OpenAPI document. Errors go through the app's own exception handlers, so
    they read as from the routes. Sits inside the body limit, the backpressure gate and
    authentication."""

    def __init__(
        self, app: Any, *, routes: Mapping[str, Callable[[Request], Awaitable[Any]]]
    ) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            root = scope.get("root_path", "")
            route = self.routes.get(path[len(root) :] if root and path.startswith(root) else path)
        if route is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        response: Response
        try:
            result = await route(request)
            if isinstance(result, Response):
                response = result
            else:  # the route's response model, as FastAPI would have written it
                response = Response(
                    result.model_dump_json(exclude_none=True), media_type="application/json"
                )  # a columnar batch's rank_commands only where there are some
        except (HTTPException, RequestValidationError) as exc:
            response = await _handled(request, exc)
        await response(scope, receive, send)


async def _handled(request: Request, exc: Exception) -> Response:
    """The app's exception handler's answer to ``exc`` (as Starlette looks it up: by class)."""
    handlers = request.app.exception_handlers
    for cls in type(exc).__mro__:
        if cls in handlers:
            response = handlers[cls](request, exc)
            return await response if inspect.isawaitable(response) else response
    raise exc


@router.get("/api/v1/runs", response_model=list[RunSummary], tags=["runs"])
def list_runs(
    request: Request, limit: Annotated[int, Query(ge=1, le=10_000)] = 200
) -> list[RunSummary]:
    """Retrieve runs, most recently updated first."""
    with _engine(request).connect() as conn:
        return queries.list_runs(conn, limit=limit)


@router.get("/api/v1/runs/{run}", response_model=RunDetail, tags=["runs"])
def get_run(run: str, request: Request) -> RunDetail:
    """Retrieve one run with its ranks."""
    with _engine(request).connect() as conn:
        return queries.get_run(conn, run=run)


@router.get("/api/v1/runs/{run}/metrics", response_model=RunMetrics, tags=["runs"])
def get_metrics(run: str, request: Request) -> RunMetrics:
    """Retrieve the series a run has: the built-in metrics and its own (``user.<name>``)."""
    with _engine(request).connect() as conn:
        return RunMetrics(**queries.run_metrics(conn, run=run, builtin=list(METRICS)))


@router.get("/api/v1/runs/{run}/ranks", response_model=list[RankInfo], tags=["runs"])
def get_ranks(run: str, request: Request) -> list[RankInfo]:
    """Retrieve the ranks of a run: host, node, process session, state, last step."""
    with _engine(request).connect() as conn:
        return queries.ranks(conn, run=run)


@router.get("/api/v1/runs/{run}/events", response_model=list[EventOut], tags=["runs"])
def get_events(
    run: str,
    request: Request,
    kind: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
) -> list[EventOut]:
    """Retrieve a run's events (start, shutdown, restart, ...) in time order."""
    with _engine(request).connect() as conn:
        return queries.events(conn, run=run, kind=kind, limit=limit)


@router.get("/api/v1/runs/{run}/series", response_model=Series, tags=["runs"])
def get_series(
    run: str,
    request: Request,
    metric: str,
    from_step: Annotated[int | None, Query(alias="from", ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(alias="to", ge=0, le=MAX_STEP)] = None,
    last: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
    points: Annotated[int | None, Query(ge=10, le=100_000)] = None,
) -> Series:
    """Retrieve one metric per step: min / median / max across ranks and the run total.

    ``points`` downsamples on the server so that spikes survive (min / max per bucket)."""
    with _engine(request).connect() as conn:
        return series.series(
            conn,
            run=run,
            metric=metric,
            from_step=from_step,
            to_step=to_step,
            last=last,
            points=points,
        )


@router.get("/api/v1/runs/{run}/heatmap", response_model=Heatmap, tags=["runs"])
def get_heatmap(
    run: str,
    request: Request,
    metric: str,
    buckets: Annotated[int, Query(ge=1, le=5000)] = 200,
    from_step: Annotated[int | None, Query(alias="from", ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(alias="to", ge=0, le=MAX_STEP)] = None,
) -> Heatmap:
    """Retrieve a rank x step-bucket matrix of a metric (a straggler shows as a stripe)."""
    with _engine(request).connect() as conn:
        return series.heatmap(
            conn, run=run, metric=metric, buckets=buckets, from_step=from_step, to_step=to_step
        )


@router.get("/api/v1/runs/{run}/ranks/{rank}/series", response_model=RankSeries, tags=["runs"])
def get_rank_series(
    run: str,
    rank: Annotated[int, Path(ge=0, le=MAX_RANK)],
    request: Request,
    metric: str,
    from_step: Annotated[int | None, Query(alias="from", ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(alias="to", ge=0, le=MAX_STEP)] = None,
    last: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
) -> RankSeries:
    """Retrieve one metric of one rank per step (e.g. each rank's own loss)."""
    with _engine(request).connect() as conn:
        return series.rank_series(
            conn, run=run, metric=metric, rank=rank, from_step=from_step, to_step=to_step, last=last
        )


@router.get("/api/v1/runs/{run}/flags", response_model=list[FlaggedStep], tags=["runs"])
def get_flags(
    run: str, request: Request, limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000
) -> list[FlaggedStep]:
    """Retrieve the steps on which a rank flagged a spike or a non-finite value."""
    with _engine(request).connect() as conn:
        return queries.flagged_steps(conn, run=run, limit=limit)


@router.get("/api/v1/runs/{run}/replaced", response_model=ReplacedSeries, tags=["runs"])
def get_replaced(
    run: str,
    request: Request,
    metric: Annotated[str, Query(description="loss, grad_norm or step_time")] = "loss",
    from_step: Annotated[int | None, Query(alias="from", ge=0, le=MAX_STEP)] = None,
    to_step: Annotated[int | None, Query(alias="to", ge=0, le=MAX_STEP)] = None,
    points: Annotated[int | None, Query(ge=2, le=100_000)] = None,
) -> ReplacedSeries:
    """Retrieve the executions of steps that a rollback or a restart replaced (the series
    keeps the steps run again): the loss spike a rollback went back from, per step across
    ranks; ``points`` downsamples, keeping each bucket's min and max."""
    with _engine(request).connect() as conn:
        return series.replaced_series(
            conn, run=run, metric=metric, points=points, from_step=from_step, to_step=to_step
        )


@router.get("/api/v1/runs/{run}/gpu", response_model=list[GpuSample], tags=["runs"])
def get_gpu(
    run: str,
    request: Request,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK)] = None,
    since: float | None = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> list[GpuSample]:
    """Retrieve NVML readings (temperature, power, clocks, throttle reasons, ECC, ...)."""
    with _engine(request).connect() as conn:
        return queries.gpu_samples(conn, run=run, rank=rank, since=since, limit=limit)


@router.get("/healthz", tags=["ops"])
def healthz(request: Request, response: Response) -> dict[str, str]:
    """Liveness and database reachability."""
    try:
        with _engine(request).connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception:
        response.status_code = 503
        response.headers["Retry-After"] = RETRY_AFTER_S
        return {"status": "degraded", "database": "unreachable"}
    return {"status": "ok", "database": "ok"}


@router.get("/metrics", tags=["ops"], response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus metrics."""
    return Response(generate_latest(_metrics(request).registry), media_type=CONTENT_TYPE_LATEST)
