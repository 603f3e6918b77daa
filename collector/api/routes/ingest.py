"""HTTP routes for ingest: ``POST /api/v1/ingest`` (one rank's batch) and
``POST /api/v1/ingest/columns`` (several ranks' steps column-wise), answered by
:class:`DirectIngest` past FastAPI's layers on the hot path; the writer stores them."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError
from starlette.requests import ClientDisconnect

from trainwarden.agent import wire
from trainwarden.collector.api import auth
from trainwarden.collector.api.prom import CollectorMetrics
from trainwarden.collector.ingest import claims
from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schemas import IngestBatch, IngestResult
from trainwarden.collector.ingest.writer import Busy, IngestWriter
from trainwarden.collector.store.db import write
from trainwarden.collector.store.errors import DomainError

log = logging.getLogger(__name__)
RETRY_AFTER_S = "5"

router = APIRouter(prefix="/api/v1/ingest", tags=["ingest"])
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
            "(TRAINWARDEN_RELAY=auto on the agents, the default where the launcher sets "
            "LOCAL_WORLD_SIZE, or `trainwarden relay`): one request a node",
            batch.run,
            batch.agent.world_size,
        )


async def submit(request: Request, batch: IngestBatch | ColumnarBatch) -> IngestResult:
    """Hand a validated batch to the group-commit writer and wait for its commit."""
    auth.check_run(batch.run)  # an ingest token may be limited to some runs
    if isinstance(batch, IngestBatch) and wire.RELAY_NAME not in request.headers.get("via", ""):
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
    "",
    response_model=IngestResult,
    openapi_extra=_body_schema(IngestBatch),
)
async def ingest(request: Request) -> IngestResult | Response:
    """Store a batch of one rank's step records, events and GPU samples. A rank that
    another live process holds is refused: 409 with the conflict, or 503 while the
    collector cannot yet tell a restart from a duplicate (``collector/ingest/claims.py``)."""
    result = await submit(request, _parse(IngestBatch, await _body(request)))
    if result.refusal is None:
        return result
    count_refusal(request, result.refusal)
    return refusal_response(result.refusal)


@router.post(
    "/columns",
    response_model=IngestResult,
    openapi_extra=_body_schema(ColumnarBatch),
)
async def ingest_columns(request: Request) -> IngestResult:
    """Store several ranks' steps in one request, column-wise (node relays, loadgen). A
    rank that another live process holds has its rows refused, and the others stored:
    ``rank_refused`` names it with the answer its agent gets (409 or 503)."""
    result = await submit(request, _parse(ColumnarBatch, await _body(request)))
    if result.rank_refused:
        for answer in result.rank_refused.values():
            count_refusal(request, answer)
    return result


def count_refusal(request: Request, answer: dict[str, Any]) -> None:
    """Count a rank refused for its claim; a conflict wakes the alert engine (its
    rank_conflict event pages now, not at the next pass)."""
    conflict = answer["status"] == claims.CONFLICT
    _metrics(request).ingest_requests.labels("conflict" if conflict else "claim_wait").inc()
    alert_engine = getattr(request.app.state, "alert_engine", None)
    if conflict and alert_engine is not None:
        alert_engine.wake()


def refusal_response(answer: dict[str, Any]) -> Response:
    """A rank's batch refused for its claim: its status, and a body naming the holder."""
    status = answer["status"]
    body = {k: v for k, v in answer.items() if k != "status"}
    headers = {"Retry-After": str(body["retry_after"])} if "retry_after" in body else None
    return JSONResponse(body, status_code=status, headers=headers)


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
        except (DomainError, HTTPException, RequestValidationError) as exc:
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
