"""OTLP metric requests built as an OpenTelemetry exporter sends them (shared by the OTLP
and authentication tests)."""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    Gauge,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

T0 = 1_700_000_000.0


def _any(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, list):
        return AnyValue(array_value=ArrayValue(values=[_any(v) for v in value]))
    return AnyValue(string_value=value)


def _kv(attributes: dict[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_any(v)) for k, v in attributes.items()]


def agent_resource(run: str = "o1", rank: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "service.name": "trainwarden-agent",
        "trainwarden.run": run,
        "trainwarden.rank": rank,
        "trainwarden.world_size": 2,
        "trainwarden.host": f"host{rank}",
        "trainwarden.node": f"node{rank}",
        "trainwarden.session": f"session-{rank}",
        **extra,
    }


def gauge(name: str, points: list[tuple[dict[str, Any], float, float | int]]) -> Metric:
    """``points``: (attributes, time in s, value); start time = time - 0.1 s."""
    return Metric(
        name=name,
        gauge=Gauge(
            data_points=[
                NumberDataPoint(
                    attributes=_kv(attrs),
                    start_time_unix_nano=int((t - 0.1) * 1e9),
                    time_unix_nano=int(t * 1e9),
                    **({"as_int": v} if isinstance(v, int) else {"as_double": v}),
                )
                for attrs, t, v in points
            ]
        ),
    )


def resource(attributes: dict[str, Any], metrics: list[Metric]) -> ResourceMetrics:
    return ResourceMetrics(
        resource=Resource(attributes=_kv(attributes)),
        scope_metrics=[ScopeMetrics(metrics=metrics)],
    )


PROTOBUF = {"Content-Type": "application/x-protobuf"}


def steps_request(
    rank: int, losses: list[float], *, run: str = "o1"
) -> ExportMetricsServiceRequest:
    """One rank's steps 0..n-1: 0.1 s each (rank 1 slower), 100 tokens, the given losses."""
    duration = 0.1 + 0.1 * rank
    ends = [(T0 + n + duration, n) for n in range(len(losses))]
    return ExportMetricsServiceRequest(
        resource_metrics=[
            resource(
                agent_resource(run, rank),
                [
                    gauge(
                        "trainwarden.step.duration",
                        [({"trainwarden.step": n}, t, duration) for t, n in ends],
                    ),
                    gauge(
                        "trainwarden.step.loss",
                        [({"trainwarden.step": n}, t, losses[n]) for t, n in ends],
                    ),
                    gauge(
                        "trainwarden.step.tokens",
                        [({"trainwarden.step": n}, t, 100) for t, n in ends],
                    ),
                ],
            )
        ]
    )
