"""The collector's own endpoints on a real database (SQLite and PostgreSQL): /healthz,
/metrics (checked by promtool, with per-run gauges), the OpenAPI document; and FastAPI's
native telemetry, turned off."""

from __future__ import annotations

import os

import pytest
from fastapi.testclient import TestClient

from ..helpers import batch, step
from .api_helpers import ingest, telemetry_step


def test_healthz_metrics_and_openapi(client: TestClient) -> None:
    ingest(client, batch(steps=[step(0)]))
    client.post("/api/v1/ingest", json={"run": "x"})
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok", "pid": os.getpid()}
    text = client.get("/metrics").text
    assert 'trainwarden_ingest_requests_total{outcome="ok"} 1.0' in text
    assert 'trainwarden_ingest_requests_total{outcome="invalid"} 1.0' in text
    assert 'trainwarden_ingest_records_total{kind="step"} 1.0' in text
    assert 'trainwarden_runs{status="running"} 1.0' in text
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/api/v1/ingest",
        "/api/v1/runs",
        "/api/v1/runs/{run}",
        "/api/v1/runs/{run}/series",
    ):
        assert path in paths


def test_metrics_pass_promtool_and_carry_per_run_gauges(client: TestClient) -> None:
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "PROMTOOL MISSING: install Debian's prometheus package (scripts/test.sh does)",
            pytrace=False,
        )
    for rank in (0, 1):
        ingest(client, batch(rank=rank, steps=[telemetry_step(i, rank=rank) for i in range(3)]))
    client.post("/api/v1/ingest", json={"run": "x"})  # one refused request, counted
    text = client.get("/metrics").text
    for line in (
        'trainwarden_run_mfu{run="r1"} 0.4',  # 8e12 FLOPs / (1 s x 20e12)
        'trainwarden_run_step_time_seconds{run="r1",stat="max"} 1.0',
        'trainwarden_run_ranks{run="r1",state="healthy"} 2.0',
        'trainwarden_run_last_step{run="r1"} 2.0',
        "trainwarden_rollup_queue_depth 0.0",
        "trainwarden_ingest_queue_rows 0.0",  # everything above was committed
        'trainwarden_ingest_requests_total{outcome="ok"} 2.0',
        'trainwarden_ingest_records_total{kind="step"} 6.0',
    ):
        assert line in text, line
    assert "trainwarden_ingest_flush_requests_count " in text
    assert 'trainwarden_collector_thread_cpu_seconds_total{thread="main"} ' in text
    assert 'trainwarden_collector_thread_cpu_seconds_total{thread="writer"} ' in text
    p99 = float(text.split('trainwarden_run_step_time_seconds{run="r1",stat="p99"} ')[1].split()[0])
    assert 0.0 < p99 <= 1.0  # at most the max
    lag = float(text.split("\ntrainwarden_ingest_lag_seconds ")[1].split()[0])
    assert 0.0 <= lag < 5.0
    assert 'trainwarden_run_exposed_comm_ratio{run="r1"} 0.3' in text  # mean of 0.2 and 0.4
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_fastapi_native_telemetry_is_off_even_with_a_global_tracer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """FastAPI's native OpenTelemetry asks on every request whether a global provider is
    set (2 % of the collector's time under ingest load): the collector turns it off. In a
    process of its own (a global provider cannot be unset): a plain FastAPI app traces
    its request there, the collector's app does not."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        from fastapi import FastAPI
        from fastapi.testclient import TestClient
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from trainwarden.collector.app import create_app
        from trainwarden.collector.store.db import make_engine, upgrade

        spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        trace.set_tracer_provider(provider)
        plain = FastAPI()
        plain.get("/ping")(lambda: {"ok": True})
        with TestClient(plain) as c:
            assert c.get("/ping").status_code == 200
        control = len(spans.get_finished_spans())
        spans.clear()
        engine = make_engine("sqlite:///DB")
        upgrade(engine)
        with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
            assert c.get("/api/v1/runs").status_code == 200
        print(control, len(spans.get_finished_spans()))
        """
    ).replace("DB", str(tmp_path / "tw.db"))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    control, ours = map(int, done.stdout.split()[-2:])
    assert control > 0, "this FastAPI traces nothing natively: the test proves nothing"
    assert ours == 0
