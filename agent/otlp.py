"""``exporter="otlp"``: the agent's batches as OpenTelemetry metrics over OTLP/HTTP.

:class:`OtlpTransport` takes the body the exporter would POST to ``/api/v1/ingest`` and
sends it to ``<url>/v1/metrics`` as an ``ExportMetricsServiceRequest`` built with
opentelemetry-sdk's data model, so the traffic can pass through an OpenTelemetry
Collector gateway. Everything in the batch is carried: steps, GPU samples, events and
the heartbeat; the tables below are the wire contract, read by the collector's
``otlp`` module too (they are plain data: this module imports OpenTelemetry only when
the transport is built).

- **Resource** (one per process): ``trainwarden.<field>`` for each of ``RESOURCE_FIELDS``
  (``trainwarden.run``, ``trainwarden.rank``, ``trainwarden.session``, ...).
- **Steps**: one gauge point per step and metric of ``STEP_METRICS``, with attribute
  ``trainwarden.step``; start time = step start, time = step end. The step's strings
  (``STEP_ATTRIBUTES``) ride as attributes of its ``trainwarden.step.duration`` point. A user
  metric (``s.metric(name, ...)``) is a gauge ``trainwarden.user.<name>``
  (``USER_METRIC_PREFIX``) of the same shape; one the agent could not read is left out.
- **GPU samples**: a gauge point per field of ``GPU_METRICS``, time = the reading, with
  the GPU's identity and throttle reasons (``GPU_ATTRIBUTES``) on every point.
- **Events**: a ``trainwarden.event`` point of value 1 whose attributes hold the event
  (id, kind, severity, step, ``data`` as JSON). OTLP logs would be the natural signal;
  a metric point keeps one pipeline and one endpoint.
- **Heartbeat**: every request has one ``trainwarden.heartbeat`` point (time = sent)
  carrying ``HEARTBEAT_FIELDS``, so a request with nothing else still beats.
"""

from __future__ import annotations

import json
from typing import Any

from .config import ConfigError
from .metric_catalog import FIELDS
from .wire import SENDER_HEADER, CollectorError, sender

OTLP_PATH = "/v1/metrics"
PREFIX = "trainwarden."

# Resource attributes ``trainwarden.<field>``: who sends (AgentInfo fields that do not change).
RESOURCE_FIELDS = (
    "run",
    "rank",
    "world_size",
    "local_rank",
    "host",
    "node",
    "pid",
    "session",
    "started_at",
    "version",
    "heartbeat_s",
)
# Attributes ``trainwarden.<field>`` of the heartbeat point: what changes per request.
HEARTBEAT_FIELDS = ("last_step", "last_step_end", "in_step", "phase")
HEARTBEAT_METRIC = "trainwarden.heartbeat"

STEP_ATTR = "trainwarden.step"
# OTLP metric name -> (the step's field, as in the catalog; its UCUM unit)
STEP_METRICS: dict[str, tuple[str, str]] = {f.otlp: (f.name, f.ucum) for f in FIELDS}
DURATION_METRIC = "trainwarden.step.duration"
USER_METRIC_PREFIX = "trainwarden.user."  # + the user metric's name (StepIn.metrics)
# StepIn field -> attribute on the step's duration point (``issues`` as a JSON object).
STEP_ATTRIBUTES = {
    "comm_source": "trainwarden.comm_source",
    "flops_source": "trainwarden.flops_source",
    "peak_source": "trainwarden.peak_source",
    "flags": "trainwarden.flags",
    "issues": "trainwarden.issues",
}

GPU_METRICS: dict[str, tuple[str, str]] = {
    "trainwarden.gpu.temperature": ("temp_c", "Cel"),
    "trainwarden.gpu.memory.temperature": ("mem_temp_c", "Cel"),
    "trainwarden.gpu.power": ("power_w", "W"),
    "trainwarden.gpu.power.limit": ("power_limit_w", "W"),
    "trainwarden.gpu.clock.sm": ("sm_clock_mhz", "MHz"),
    "trainwarden.gpu.clock.sm.max": ("sm_clock_max_mhz", "MHz"),
    "trainwarden.gpu.utilization": ("util_gpu", "%"),
    "trainwarden.gpu.memory.utilization": ("util_mem", "%"),
    "trainwarden.gpu.memory.used": ("mem_used_bytes", "By"),
    "trainwarden.gpu.memory.total": ("mem_total_bytes", "By"),
    "trainwarden.gpu.ecc.corrected": ("ecc_corrected", "{error}"),
    "trainwarden.gpu.ecc.uncorrected": ("ecc_uncorrected", "{error}"),
    "trainwarden.gpu.retired_pages": ("retired_pages", "{page}"),
    "trainwarden.gpu.remapped_rows.correctable": ("remapped_rows_correctable", "{row}"),
    "trainwarden.gpu.remapped_rows.uncorrectable": ("remapped_rows_uncorrectable", "{row}"),
    "trainwarden.gpu.pcie.replay": ("pcie_replay", "{replay}"),
}
# GpuSampleIn field -> attribute on every point of one reading.
GPU_ATTRIBUTES = {
    "gpu_uuid": "trainwarden.gpu.uuid",
    "gpu_name": "trainwarden.gpu.name",
    "throttle": "trainwarden.gpu.throttle",
    "remap_pending": "trainwarden.gpu.remap_pending",
    "recovery_action": "trainwarden.gpu.recovery_action",
    "simulated": "trainwarden.gpu.simulated",
}

EVENT_METRIC = "trainwarden.event"
# EventIn field -> attribute of the event point (``data`` as a JSON object; step as STEP_ATTR).
EVENT_ATTRIBUTES = {
    "id": "trainwarden.event.id",
    "kind": "trainwarden.event.kind",
    "severity": "trainwarden.event.severity",
    "step": STEP_ATTR,
    "data": "trainwarden.event.data",
}
JSON_ATTRIBUTES = frozenset({"trainwarden.issues", "trainwarden.event.data"})

_NS = 1_000_000_000


def _ns(seconds: float) -> int:
    return int(round(seconds * _NS))


def _number(value: Any) -> int | float:
    # The native form sends NaN / Inf as strings ("nan", "inf"); OTLP doubles carry them as such.
    if isinstance(value, str):
        return float(value)
    return value  # type: ignore[no-any-return]


def _attribute(value: Any) -> Any:
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), default=str)
    if isinstance(value, list):
        return [str(v) for v in value]
    return value


class OtlpTransport:
    """A :class:`~trainwarden.agent.exporter.Transport` that speaks OTLP/HTTP (protobuf)."""

    def __init__(self, url: str, *, token: str | None, timeout_s: float) -> None:
        try:  # imported here so that `import trainwarden.agent` stays light
            import requests
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )
            from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
                ExportMetricsServiceResponse,
            )
            from opentelemetry.sdk.metrics import export as sdk
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        except ImportError as exc:
            raise ConfigError(
                f"exporter='otlp' needs OpenTelemetry ({exc.name} is missing): "
                "pip install 'trainwarden[otlp]', or use exporter='http'"
            ) from None
        self._sdk = sdk
        self._resource_type = Resource
        self._response_type = ExportMetricsServiceResponse
        self._scope = InstrumentationScope("trainwarden.agent")
        self._resource: tuple[tuple[Any, ...], Any] | None = None
        # The SDK's export() says only SUCCESS or FAILURE; the session's hook keeps the
        # last response so that a failure can carry its status and Retry-After.
        self._session = requests.Session()
        self._session.hooks["response"].append(self._seen)
        self._last: Any = None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.endpoint = url.rstrip("/") + OTLP_PATH
        self._exporter = OTLPMetricExporter(
            endpoint=self.endpoint, headers=headers, timeout=timeout_s, session=self._session
        )

    def _seen(self, response: Any, *args: Any, **kwargs: Any) -> Any:
        self._last = response
        return response

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Send one native batch body (``path`` is the native route; OTLP has its own)."""
        data = self.metrics_data(body)
        self._session.headers[SENDER_HEADER] = sender(body)  # a 503 still counts as a beat
        self._last = None
        result = self._exporter.export(data)
        response = self._last
        if result is self._sdk.MetricExportResult.SUCCESS:
            return self._partial_success(response)
        if response is None:  # no answer: the exporter retries it like an unreachable collector
            raise ConnectionError(f"OTLP export to {self.endpoint} failed: no response")
        retry_after = response.headers.get("Retry-After", "")
        wait = float(retry_after) if retry_after.replace(".", "", 1).isdigit() else None
        raise CollectorError(response.status_code, response.text[:500], wait)

    def _partial_success(self, response: Any) -> dict[str, Any]:
        if response is None or not response.content:
            return {}
        reply = self._response_type()
        if response.headers.get("Content-Type", "").startswith("application/json"):
            return dict(response.json())
        try:
            reply.ParseFromString(response.content)
        except Exception:
            return {}
        partial = reply.partial_success
        if not partial.rejected_data_points and not partial.error_message:
            return {}
        return {
            "rejected_data_points": partial.rejected_data_points,
            "error_message": partial.error_message,
        }

    def close(self) -> None:
        self._exporter.shutdown()

    # -- the native body as OTLP metrics --------------------------------------------

    def metrics_data(self, body: dict[str, Any]) -> Any:
        """``body`` (``{run, agent, steps, events, gpu}``) as an SDK ``MetricsData``."""
        sdk = self._sdk
        points: dict[str, list[Any]] = {}

        def add(
            name: str, value: Any, attributes: dict[str, Any], end: float, start: float = 0
        ) -> None:
            points.setdefault(name, []).append(
                sdk.NumberDataPoint(
                    attributes=attributes,
                    start_time_unix_nano=_ns(start) if start else 0,
                    time_unix_nano=_ns(end),
                    value=_number(value),
                )
            )

        agent = body["agent"]
        beat = {PREFIX + f: agent[f] for f in HEARTBEAT_FIELDS if agent.get(f) is not None}
        add(HEARTBEAT_METRIC, 1, beat, agent.get("sent_at") or 0.0)
        for step in body.get("steps", ()):
            start, end = step["ts"], step["ts"] + step["duration_s"]
            attributes = {STEP_ATTR: step["step"]}
            for name, (field, _unit) in STEP_METRICS.items():
                if step.get(field) is None:
                    continue
                if name == DURATION_METRIC:
                    extra = {
                        a: _attribute(step[f]) for f, a in STEP_ATTRIBUTES.items() if step.get(f)
                    }
                    add(name, step[field], {**attributes, **extra}, end, start)
                else:
                    add(name, step[field], attributes, end, start)
            for name, value in (step.get("metrics") or {}).items():
                if value is not None:
                    add(USER_METRIC_PREFIX + name, value, attributes, end, start)
        for sample in body.get("gpu", ()):
            attributes = {
                a: _attribute(sample[f])
                for f, a in GPU_ATTRIBUTES.items()
                if sample.get(f) is not None
            }
            for name, (field, _unit) in GPU_METRICS.items():
                if sample.get(field) is not None:
                    add(name, sample[field], attributes, sample["ts"])
        for event in body.get("events", ()):
            attributes = {
                a: _attribute(event[f])
                for f, a in EVENT_ATTRIBUTES.items()
                if event.get(f) is not None
            }
            add(EVENT_METRIC, 1, attributes, event["ts"])

        units = {name: unit for name, (_field, unit) in {**STEP_METRICS, **GPU_METRICS}.items()}
        metrics = [
            sdk.Metric(
                name=n, description=None, unit=units.get(n, "1"), data=sdk.Gauge(data_points=p)
            )
            for n, p in points.items()
        ]
        scope = sdk.ScopeMetrics(scope=self._scope, metrics=metrics, schema_url="")
        return sdk.MetricsData(
            resource_metrics=[
                sdk.ResourceMetrics(
                    resource=self._resource_for(body["run"], agent),
                    scope_metrics=[scope],
                    schema_url="",
                )
            ]
        )

    def _resource_for(self, run: str, agent: dict[str, Any]) -> Any:
        identity = {"run": run, **agent}
        key = tuple(identity.get(f) for f in RESOURCE_FIELDS)
        if self._resource is None or self._resource[0] != key:
            attributes = {
                PREFIX + f: v for f, v in zip(RESOURCE_FIELDS, key, strict=True) if v is not None
            }
            attributes["service.name"] = "trainwarden-agent"
            # Resource.create adds the SDK's attributes and OTEL_RESOURCE_ATTRIBUTES.
            self._resource = (key, self._resource_type.create(attributes))
        return self._resource[1]
