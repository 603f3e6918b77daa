"""``POST /v1/metrics``: OTLP/HTTP metrics, so agents can send through an OpenTelemetry
Collector gateway.

The metric and attribute names are the agent's (``trainwarden.agent.otlp``: the wire
contract). Each resource that carries trainwarden metrics is one agent's batch: it is
turned into the same :class:`IngestBatch` the native route takes and stored through the
same path (validation, idempotency, metrics). Points of metrics trainwarden does not
know are ignored and reported in the response's ``partial_success``. A malformed
request (undecodable body, a trainwarden point without its run / rank / step, a bad
value) is a 400 naming the problem, and nothing of it is stored.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections import defaultdict
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from pydantic import ValidationError

from trainwarden.agent.otlp import (
    DURATION_METRIC,
    EVENT_ATTRIBUTES,
    EVENT_METRIC,
    GPU_ATTRIBUTES,
    GPU_METRICS,
    HEARTBEAT_FIELDS,
    HEARTBEAT_METRIC,
    JSON_ATTRIBUTES,
    PREFIX,
    RESOURCE_FIELDS,
    STEP_ATTR,
    STEP_ATTRIBUTES,
    STEP_METRICS,
    USER_METRIC_PREFIX,
)
from trainwarden.collector.api import auth
from trainwarden.collector.api.routes.ingest import count_refusal, refusal_response, submit
from trainwarden.collector.ingest import claims
from trainwarden.collector.ingest.schemas import IngestBatch

router = APIRouter()

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
_REQUIRED = ("run", "rank", "world_size", "session")


class BadRequest(ValueError):
    """The request cannot be stored; the message says why."""


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    return None if kind is None else getattr(any_value, kind)


def _attributes(key_values: Any) -> dict[str, Any]:
    out = {kv.key: _value(kv.value) for kv in key_values}
    for name in JSON_ATTRIBUTES & out.keys():
        if isinstance(out[name], str):
            try:
                out[name] = json.loads(out[name])
            except ValueError:
                raise BadRequest(f"attribute {name} is not a JSON object") from None
    return out


def _points(metric: Any) -> Any:
    kind = metric.WhichOneof("data")
    return getattr(metric, kind).data_points if kind in ("gauge", "sum") else None


def _number(point: Any) -> int | float:
    return point.as_int if point.WhichOneof("value") == "as_int" else point.as_double


def _agent(resource: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """The run and the agent header from a resource's ``trainwarden.*`` attributes."""
    fields = {f: resource[PREFIX + f] for f in RESOURCE_FIELDS if PREFIX + f in resource}
    fields.setdefault("host", resource.get("host.name", "unknown"))
    missing = [PREFIX + f for f in _REQUIRED if f not in fields]
    if missing:
        raise BadRequest(
            f"{where} has trainwarden metrics but lacks resource attributes "
            f"{', '.join(missing)}: the agent sets them; a gateway must keep them"
        )
    return str(fields.pop("run")), fields


def _batches(request: Any) -> tuple[list[tuple[IngestBatch, int]], dict[str, int]]:
    """One IngestBatch per resource with trainwarden metrics, with its number of points;
    points of unknown metrics."""
    batches = []
    unknown: dict[str, int] = defaultdict(int)
    known = {*STEP_METRICS, *GPU_METRICS, EVENT_METRIC, HEARTBEAT_METRIC}
    for r, resource_metrics in enumerate(request.resource_metrics):
        where = f"resource_metrics[{r}]"
        ours = []
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                ours_by_name = metric.name in known or metric.name.startswith(USER_METRIC_PREFIX)
                if ours_by_name and _points(metric) is not None:
                    ours.append(metric)
                else:  # another metric, or ours as a histogram: not a column
                    kind = metric.WhichOneof("data")
                    unknown[metric.name] += len(getattr(metric, kind).data_points) if kind else 0
        if ours:
            points = sum(len(_points(metric)) for metric in ours)
            batches.append((_batch(resource_metrics, ours, where), points))
    return batches, dict(unknown)


def _batch(resource_metrics: Any, metrics: list[Any], where: str) -> IngestBatch:
    """One agent's batch from its resource and its trainwarden metrics."""
    run, agent = _agent(_attributes(resource_metrics.resource.attributes), where)
    steps: dict[int, dict[str, Any]] = defaultdict(dict)
    step_ends: dict[int, int] = {}
    gpu: dict[tuple[int, Any], dict[str, Any]] = defaultdict(dict)
    events: list[dict[str, Any]] = []
    for metric in metrics:
        for i, point in enumerate(_points(metric)):
            attrs = _attributes(point.attributes)
            name = metric.name
            user = name.startswith(USER_METRIC_PREFIX)
            if name in STEP_METRICS or user:
                if STEP_ATTR not in attrs:
                    raise BadRequest(
                        f"{where} (run {run}, rank {agent['rank']}): point {i} of {name} "
                        f"lacks attribute {STEP_ATTR}"
                    )
                step = steps[attrs[STEP_ATTR]]
                step["step"] = attrs[STEP_ATTR]
                if user:  # the name is checked with the step (StepIn.metrics)
                    step.setdefault("metrics", {})[name[len(USER_METRIC_PREFIX) :]] = _number(point)
                else:
                    step[STEP_METRICS[name][0]] = _number(point)
                if point.start_time_unix_nano:
                    step["ts"] = point.start_time_unix_nano / 1e9
                step_ends[attrs[STEP_ATTR]] = point.time_unix_nano
                for field, attr in STEP_ATTRIBUTES.items():
                    if attr in attrs:
                        step[field] = attrs[attr]
            elif name in GPU_METRICS:
                sample = gpu[(point.time_unix_nano, attrs.get(GPU_ATTRIBUTES["gpu_uuid"]))]
                sample["ts"] = point.time_unix_nano / 1e9
                sample[GPU_METRICS[name][0]] = _number(point)
                sample.update({f: attrs[a] for f, a in GPU_ATTRIBUTES.items() if a in attrs})
            elif name == EVENT_METRIC:
                event = {f: attrs[a] for f, a in EVENT_ATTRIBUTES.items() if a in attrs}
                events.append({**event, "ts": point.time_unix_nano / 1e9})
            else:  # the heartbeat: what the rank was doing when it sent
                beat = {f: attrs[PREFIX + f] for f in HEARTBEAT_FIELDS if PREFIX + f in attrs}
                agent.update(beat)
                agent["sent_at"] = point.time_unix_nano / 1e9 or None
    for n, step in steps.items():
        if "duration_s" not in step:
            raise BadRequest(
                f"{where} (run {run}, rank {agent['rank']}): step {n} has no "
                f"{DURATION_METRIC} point"
            )
        step.setdefault("ts", step_ends[n] / 1e9 - step["duration_s"])
    try:
        return IngestBatch.model_validate(
            {
                "run": run,
                "agent": agent,
                "steps": sorted(steps.values(), key=lambda s: s["step"]),
                "events": events,
                "gpu": list(gpu.values()),
            }
        )
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise BadRequest(f"{where} (run {run}): {errors}") from None


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    if encoding in ("", "identity"):
        return body
    if encoding not in ("gzip", "deflate"):
        raise HTTPException(415, f"Content-Encoding {encoding!r} is not supported: use gzip")
    inflate = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflate.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BadRequest(f"body is not valid {encoding}: {exc}") from None
    if len(out) > limit:
        raise HTTPException(413, f"request body is over the {limit:,}-byte limit once inflated")
    return out


def _parse(body: bytes, content_type: str) -> ExportMetricsServiceRequest:
    message = ExportMetricsServiceRequest()
    if content_type == JSON:
        try:
            json_format.Parse(body, message, ignore_unknown_fields=True)
        except (json_format.ParseError, UnicodeDecodeError) as exc:
            raise BadRequest(
                f"body is not a valid OTLP/JSON ExportMetricsServiceRequest: {exc}"
            ) from None
        return message
    try:
        message.ParseFromString(body)
    except DecodeError as exc:
        raise BadRequest(
            f"body is not a valid OTLP ExportMetricsServiceRequest (protobuf): {exc}"
        ) from None
    return message


def _reply(reply: ExportMetricsServiceResponse, content_type: str) -> Response:
    if content_type == JSON:
        return Response(json_format.MessageToJson(reply, indent=None), media_type=JSON)
    return Response(reply.SerializeToString(), media_type=PROTOBUF)


@router.post(
    "/v1/metrics",
    tags=["ingest"],
    response_class=Response,
    responses={200: {"content": {PROTOBUF: {}, JSON: {}}}},
)
async def otlp_metrics(request: Request) -> Response:
    """Store OTLP/HTTP metrics (an ExportMetricsServiceRequest, protobuf or JSON).

    A resource whose rank another live process holds (``collector/ingest/claims.py``) is
    refused, as on the native route: when every resource of the request was refused,
    the answer is the refusal's (409 naming the holder; 503 with ``Retry-After`` while a
    restart cannot yet be told from a duplicate); otherwise the others are stored, a 503
    asks for the whole request again (what was stored is stored once), and the refused
    ranks' points are counted in ``partial_success`` with why."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type not in (PROTOBUF, "application/protobuf", JSON):
        raise HTTPException(
            415, f"Content-Type {content_type or 'none'!r}: send {PROTOBUF} or {JSON}"
        )
    limit = request.app.state.settings.max_body_bytes
    encoding = request.headers.get("content-encoding", "").strip().lower()
    try:
        body = _decompress(await request.body(), encoding, limit)
        batches, unknown = _batches(_parse(body, content_type))
    except BadRequest as exc:
        request.app.state.metrics.ingest_requests.labels("invalid").inc()
        raise HTTPException(400, str(exc)) from None
    for batch, _ in batches:  # all or nothing: no run is stored if one is not allowed
        auth.check_run(batch.run)
    # Submitted together, the resources of one request share one group commit.
    results = await asyncio.gather(*(submit(request, batch) for batch, _ in batches))
    refused = [
        (batch, points, result.refusal)
        for (batch, points), result in zip(batches, results, strict=True)
        if result.refusal is not None
    ]
    for _, _, answer in refused:
        count_refusal(request, answer)
    waits = [answer for _, _, answer in refused if answer["status"] != claims.CONFLICT]
    if refused and (waits or len(refused) == len(batches)):
        return refusal_response(
            max(waits, key=lambda a: a.get("retry_after", 0), default=refused[0][2])
        )

    reply = ExportMetricsServiceResponse()
    if refused:
        reply.partial_success.rejected_data_points = sum(points for _, points, _ in refused)
        reply.partial_success.error_message = "; ".join(
            f"run {batch.run} rank {batch.agent.rank}: {answer['detail']}"
            for batch, _, answer in refused
        )
    if unknown:
        names = sorted(unknown, key=lambda n: -unknown[n])
        listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        reply.partial_success.rejected_data_points += sum(unknown.values())
        said = reply.partial_success.error_message
        reply.partial_success.error_message = (
            f"{said}; " if said else ""
        ) + f"ignored points of metrics trainwarden does not know: {listed}"
    return _reply(reply, content_type)
