"""``POST /v1/metrics``: OTLP/HTTP bodies built with opentelemetry-proto, on SQLite and
PostgreSQL, stored through the native ingest path."""

from __future__ import annotations

import gzip
import math
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    Histogram,
    HistogramDataPoint,
    Metric,
    ResourceMetrics,
)
from sqlalchemy import select

from trainwarden.agent.otlp import OtlpTransport
from trainwarden.collector.app import create_app
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m

from ..helpers import batch
from ..otlp_scenario import PROTOBUF, T0, agent_resource, gauge, resource, steps_request


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def post(client: TestClient, request: ExportMetricsServiceRequest, **kwargs: Any) -> Any:
    return client.post(
        "/v1/metrics", content=request.SerializeToString(), headers=PROTOBUF, **kwargs
    )


def reply(response: Any) -> ExportMetricsServiceResponse:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-protobuf"
    out = ExportMetricsServiceResponse()
    out.ParseFromString(response.content)
    return out


def rows(client: TestClient, run: str) -> list[dict[str, Any]]:
    with client.app.state.engine.connect() as conn:
        run_id = conn.execute(select(m.runs.c.id).where(m.runs.c.name == run)).scalar_one()
        query = select(m.rank_steps).where(m.rank_steps.c.run_id == run_id)
        return [dict(r._mapping) for r in conn.execute(query.order_by("rank", "step"))]


def series(client: TestClient, metric: str, run: str = "o1") -> dict[str, Any]:
    flush(client.app.state.engine, now=time.time(), grace_s=0)
    response = client.get(f"/api/v1/runs/{run}/series", params={"metric": metric})
    assert response.status_code == 200, response.text
    return response.json()


def test_steps_of_two_ranks_become_rows_and_roll_up(client: TestClient) -> None:
    for rank, losses in ((0, [2.0, 1.8]), (1, [2.4, 1.6])):
        answer = reply(post(client, steps_request(rank, losses)))
        assert not answer.HasField("partial_success")

    loss = series(client, "loss")
    assert loss["step"] == [0, 1] and loss["n"] == [2, 2]
    assert loss["min"] == [2.0, 1.6] and loss["max"] == [2.4, 1.8]
    step_time = series(client, "step_time")
    assert step_time["total"] == pytest.approx([0.2, 0.2])  # the slower rank
    assert step_time["argmax_rank"] == [1, 1]
    assert series(client, "tokens")["total"] == [200, 200]

    stored = rows(client, "o1")
    assert [(r["rank"], r["step"]) for r in stored] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert stored[1]["ts"] == pytest.approx(T0 + 1.0)  # the point's start time
    ranks = client.get("/api/v1/runs/o1/ranks").json()
    assert [(r["host"], r["node"], r["session"]) for r in ranks] == [
        ("host0", "node0", "session-0"),
        ("host1", "node1", "session-1"),
    ]


def test_every_column_events_and_gpu_samples_match_the_native_route(client: TestClient) -> None:
    """The agent's OTLP encoding of a full batch stores what the native JSON route stores."""
    # fmt: off
    step = {
        "step": 7, "ts": T0, "duration_s": 0.5, "data_wait_s": 0.01, "tokens": 4096, "loss": "nan",
        "grad_norm": 1.5, "fwd_s": 0.1, "bwd_s": 0.3, "opt_s": 0.05, "other_s": 0.05,
        "compute_s": 0.4, "exposed_comm_s": 0.06, "overlapped_comm_s": 0.1, "idle_s": 0.04,
        "comm_source": "hook", "flops": 1e12, "mfu": 0.41, "peak_flops": 9.89e14,
        "flops_source": "given: flops_per_token", "peak_source": "table: H100 SXM bf16",
        "mem_allocated_bytes": 2**30, "mem_reserved_bytes": 2**31, "rss_bytes": 2**29,
        "flags": ["grad_norm_spike", "nonfinite_loss"], "issues": {"loss": "nan"},
    }
    gpu = {
        "ts": T0 + 1, "gpu_uuid": "GPU-1234", "gpu_name": "NVIDIA H100", "temp_c": 71.0,
        "mem_temp_c": 80.0, "power_w": 650.5, "power_limit_w": 700.0, "sm_clock_mhz": 1755.0,
        "sm_clock_max_mhz": 1980.0, "throttle": ["sw_power_cap"], "util_gpu": 99.0,
        "util_mem": 40.0, "mem_used_bytes": 70 * 2**30, "mem_total_bytes": 80 * 2**30,
        "ecc_corrected": 3, "ecc_uncorrected": 0, "retired_pages": 1,
        "remapped_rows_correctable": 2, "remapped_rows_uncorrectable": 0, "remap_pending": False,
        "pcie_replay": 5, "recovery_action": "none", "simulated": True,
    }
    event = {
        "id": "e-1", "kind": "xid", "ts": T0 + 2, "step": 7, "severity": "critical",
        "data": {"code": 79, "action": "reboot_node", "nested": {"a": [1, 2]}},
    }
    # fmt: on
    for run in ("native", "otlp"):
        body = batch(run, rank=1, steps=[step])
        body["agent"].update(
            sent_at=T0 + 3,
            heartbeat_s=2.0,
            last_step=7,
            in_step=False,
            phase="optimizer",
            last_step_end=T0 + 0.5,
            version="0.1.0",
        )
        body["gpu"], body["events"] = [gpu], [{**event, "id": f"{run}-e-1"}]
        if run == "native":
            assert client.post("/api/v1/ingest", json=body).status_code == 200
            continue
        transport = OtlpTransport("http://127.0.0.1:9", token=None, timeout_s=1.0)
        request = encode_metrics(transport.metrics_data(body))
        transport.close()
        assert not reply(post(client, request)).HasField("partial_success")

    native, otlp = rows(client, "native")[0], rows(client, "otlp")[0]
    for row in (native, otlp):
        del row["run_id"], row["recv_ts"]
        loss = row.pop("loss")
        assert loss is None or math.isnan(loss)  # SQLite keeps NaN as NULL
    assert otlp == native
    assert otlp["tokens"] == 4096 and otlp["flags"] == ["grad_norm_spike", "nonfinite_loss"]

    def strip(rows: list[dict[str, Any]], drop: tuple[str, ...]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in drop} for r in rows]

    gpu_of = {run: client.get(f"/api/v1/runs/{run}/gpu").json() for run in ("native", "otlp")}
    assert gpu_of["otlp"] == gpu_of["native"] and len(gpu_of["otlp"]) == 1
    assert gpu_of["otlp"][0]["throttle"] == ["sw_power_cap"]
    events = {
        run: strip(
            client.get(f"/api/v1/runs/{run}/events", params={"kind": "xid"}).json(),
            ("id", "recv_ts"),
        )
        for run in ("native", "otlp")
    }
    assert events["otlp"] == events["native"] and events["otlp"][0]["data"]["nested"] == {
        "a": [1, 2]
    }
    ranks = {
        run: strip(
            client.get(f"/api/v1/runs/{run}/ranks").json(),
            ("first_seen", "last_seen", "clock_skew_s", "state_since"),
        )
        for run in ("native", "otlp")
    }
    assert ranks["otlp"] == ranks["native"]
    assert ranks["otlp"][0]["phase"] == "optimizer" and ranks["otlp"][0]["last_step"] == 7


def test_a_replayed_request_changes_nothing(client: TestClient) -> None:
    request = steps_request(0, [2.0, 1.8])
    request.resource_metrics[0].scope_metrics[0].metrics.append(
        gauge(
            "trainwarden.event",
            [({"trainwarden.event.id": "ev-1", "trainwarden.event.kind": "restart"}, T0, 1)],
        )
    )
    for _ in range(3):
        reply(post(client, request))
    assert len(rows(client, "o1")) == 2
    assert len(client.get("/api/v1/runs/o1/events").json()) == 1
    assert series(client, "loss")["n"] == [1, 1]


def test_gzip_and_json_bodies_are_accepted(client: TestClient) -> None:
    # An OpenTelemetry Collector's otlphttp exporter compresses with gzip by default.
    body = gzip.compress(steps_request(0, [2.0]).SerializeToString())
    response = client.post(
        "/v1/metrics", content=body, headers={**PROTOBUF, "Content-Encoding": "gzip"}
    )
    assert not reply(response).HasField("partial_success")

    as_json = json_format.MessageToJson(steps_request(1, [3.0]))
    response = client.post(
        "/v1/metrics", content=as_json, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.json() == {}
    assert series(client, "loss")["max"] == [3.0]


def test_unknown_metrics_are_ignored_and_counted(client: TestClient) -> None:
    request = steps_request(0, [2.0, 1.8])
    ours = request.resource_metrics[0].scope_metrics[0].metrics
    ours.append(gauge("process.cpu.utilization", [({}, T0, 0.5), ({}, T0 + 1, 0.6)]))
    ours.append(  # a known name as a histogram is not a column either
        Metric(
            name="trainwarden.step.loss",
            histogram=Histogram(data_points=[HistogramDataPoint(count=1)]),
        )
    )
    # Through a gateway, other services' metrics may come along: no trainwarden attributes.
    request.resource_metrics.append(
        resource({"service.name": "other"}, [gauge("http.server.duration", [({}, T0, 0.1)] * 3)])
    )
    answer = reply(post(client, request))
    assert answer.partial_success.rejected_data_points == 2 + 1 + 3
    message = answer.partial_success.error_message
    assert "http.server.duration" in message and "process.cpu.utilization" in message
    assert len(rows(client, "o1")) == 2


def test_undecodable_body_is_a_400_and_nothing_is_stored(client: TestClient) -> None:
    # Field 1 (resource_metrics) announces 5 bytes and has 2: a truncated message.
    response = client.post("/v1/metrics", content=b"\x0a\x05ab", headers=PROTOBUF)
    assert response.status_code == 400
    assert "not a valid OTLP ExportMetricsServiceRequest (protobuf)" in response.json()["detail"]

    response = client.post(
        "/v1/metrics", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400 and "OTLP/JSON" in response.json()["detail"]

    response = client.post("/v1/metrics", content=b"x", headers={"Content-Type": "text/plain"})
    assert response.status_code == 415 and "application/x-protobuf" in response.json()["detail"]

    response = client.post(
        "/v1/metrics", content=b"not gzip", headers={**PROTOBUF, "Content-Encoding": "gzip"}
    )
    assert response.status_code == 400 and "gzip" in response.json()["detail"]
    assert client.get("/api/v1/runs").json() == []
    metrics = client.get("/metrics").text
    assert 'trainwarden_ingest_requests_total{outcome="invalid"} 3.0' in metrics


def test_missing_attributes_are_named_and_nothing_is_stored(client: TestClient) -> None:
    request = steps_request(0, [2.0])
    good = steps_request(1, [2.0]).resource_metrics[0]
    request.resource_metrics.append(good)
    attrs = request.resource_metrics[0].resource.attributes
    kept = [kv for kv in attrs if kv.key not in ("trainwarden.run", "trainwarden.session")]
    del attrs[:]
    attrs.extend(kept)
    response = post(client, request)
    assert response.status_code == 400
    detail = response.json()["detail"]
    assert "resource_metrics[0]" in detail
    assert "lacks resource attributes trainwarden.run, trainwarden.session" in detail

    request = steps_request(0, [2.0, 1.8])
    loss = request.resource_metrics[0].scope_metrics[0].metrics[1]
    del loss.gauge.data_points[1].attributes[:]
    response = post(client, request)
    assert response.status_code == 400
    assert (
        "point 1 of trainwarden.step.loss lacks attribute trainwarden.step"
        in response.json()["detail"]
    )

    request = steps_request(0, [2.0])
    del request.resource_metrics[0].scope_metrics[0].metrics[0]  # no duration
    response = post(client, request)
    assert response.status_code == 400
    assert "step 0 has no trainwarden.step.duration point" in response.json()["detail"]

    request = steps_request(0, [2.0])
    request.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points[0].as_double = -1.0
    response = post(client, request)
    assert response.status_code == 400
    assert (
        "steps.0.duration_s: Input should be greater than or equal to 0"
        in response.json()["detail"]
    )
    assert client.get("/api/v1/runs").json() == []  # the good resource was not stored either


def claimant(session: str, pid: int, started: float, losses: list[float]) -> ResourceMetrics:
    """Rank 0's steps from the process ``session`` (``pid``, started at ``started``)."""
    (res,) = steps_request(0, losses).resource_metrics
    said = {"session": session, "pid": pid, "started_at": started, "heartbeat_s": 2.0}
    attrs = agent_resource(**{f"trainwarden.{k}": v for k, v in said.items()})
    return resource(attrs, list(res.scope_metrics[0].metrics))


def test_a_second_live_process_of_a_rank_is_refused_as_on_the_native_route(
    client: TestClient,
) -> None:
    """A double launch sending OTLP: the holder keeps the rank; the second process alone
    is refused 409 naming the holder (its exporter then stops sending, as the native
    one does); in a request that also carries the holder's points, they are stored and
    the second's are counted as rejected, with why."""
    now = time.time()
    holder = claimant("a", 1000, now - 60, [1.0, 1.0, 1.0])
    assert post(client, ExportMetricsServiceRequest(resource_metrics=[holder])).status_code == 200
    second = claimant("b", 2000, now - 1, [9.0, 9.0, 9.0])  # started before a's last request
    alone = post(client, ExportMetricsServiceRequest(resource_metrics=[second]))
    assert alone.status_code == 409, alone.text
    assert alone.json()["holder"]["pid"] == 1000 and "pid 1000" in alone.json()["detail"]

    other = claimant("c", 3000, now - 1, [7.0, 7.0, 7.0])
    (res,) = steps_request(1, [2.0, 2.0, 2.0]).resource_metrics  # rank 1: its own
    mixed = post(client, ExportMetricsServiceRequest(resource_metrics=[other, res]))
    out = reply(mixed)
    assert out.partial_success.rejected_data_points == 9  # 3 metrics x 3 steps
    assert "run o1 rank 0:" in out.partial_success.error_message
    assert "pid 1000" in out.partial_success.error_message
    stored = {(r["rank"], r["step"]): r["loss"] for r in rows(client, "o1")}
    assert stored == {(0, n): 1.0 for n in range(3)} | {(1, n): 2.0 for n in range(3)}
