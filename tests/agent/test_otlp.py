"""``exporter="otlp"``: configuration, the light import, and how the transport answers a
real HTTP server's refusals (the exporter's retry rules depend on it)."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from trainwarden.agent.config import AgentConfig, ConfigError
from trainwarden.agent.exporter import CollectorError
from trainwarden.agent.otlp import OtlpTransport

from ..net import free_port


def test_exporter_is_http_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRAINWARDEN_EXPORTER", raising=False)
    assert AgentConfig.resolve(run="r").exporter == "http"
    monkeypatch.setenv("TRAINWARDEN_EXPORTER", "otlp")
    assert AgentConfig.resolve(run="r").exporter == "otlp"
    assert AgentConfig.resolve(run="r", exporter="http").exporter == "http"
    with pytest.raises(ConfigError, match=r"exporter 'otel' is not known: use one of http, otlp"):
        AgentConfig.resolve(run="r", exporter="otel")


def test_opentelemetry_is_imported_only_for_the_otlp_exporter() -> None:
    code = (
        "import sys, trainwarden.agent as tw\n"
        "tw.init(run='r', url='http://127.0.0.1:9', profile_every=0)\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'http'\n"
        "tw.init(run='r', url='http://127.0.0.1:9', profile_every=0, exporter='otlp')\n"
        "assert 'opentelemetry.sdk.metrics' in sys.modules\n"
        "tw.shutdown()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, capture_output=True)


def test_without_opentelemetry_init_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['opentelemetry.sdk'] = None  # as if opentelemetry-sdk were not installed\n"
        "import trainwarden.agent as tw\n"
        "try:\n"
        "    tw.init(run='r', url='http://127.0.0.1:9', exporter='otlp', profile_every=0)\n"
        "except tw.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=60, capture_output=True, text=True
    )
    assert "pip install 'trainwarden[otlp]'" in out.stdout


class _Collector(BaseHTTPRequestHandler):
    answer: tuple[int, dict[str, str], bytes] = (200, {}, b"")
    seen: list[tuple[str, dict[str, str], bytes]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        status, headers, content = self.answer
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(content))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(content)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, type[_Collector]]]:
    handler = type("Handler", (_Collector,), {"seen": []})
    httpd = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}", handler
    httpd.shutdown()
    httpd.server_close()


def _body() -> dict[str, Any]:
    agent = {"rank": 0, "world_size": 1, "host": "h", "session": "s", "sent_at": 1.7e9}
    step = {"step": 3, "ts": 1.7e9, "duration_s": 0.25, "loss": 2.5, "tokens": 10}
    return {"run": "r", "agent": agent, "steps": [step], "events": [], "gpu": []}


def test_sends_protobuf_to_v1_metrics_with_the_token(server: tuple[str, Any]) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
        ExportMetricsServiceResponse,
    )

    url, handler = server
    partial = ExportMetricsServiceResponse()
    partial.partial_success.rejected_data_points = 2
    partial.partial_success.error_message = "ignored"
    handler.answer = (200, {"Content-Type": "application/x-protobuf"}, partial.SerializeToString())
    transport = OtlpTransport(url, token="sekrit", timeout_s=2.0)
    assert transport.send("/api/v1/ingest", _body()) == {
        "rejected_data_points": 2,
        "error_message": "ignored",
    }
    transport.close()
    path, headers, body = handler.seen[0]
    assert path == "/v1/metrics"
    assert headers["authorization"] == "Bearer sekrit"
    assert headers["content-type"] == "application/x-protobuf"
    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    names = {m.name for m in request.resource_metrics[0].scope_metrics[0].metrics}
    assert names == {
        "trainwarden.heartbeat",
        "trainwarden.step.duration",
        "trainwarden.step.loss",
        "trainwarden.step.tokens",
    }


def test_refusals_become_collector_errors_for_the_retry_rules(server: tuple[str, Any]) -> None:
    url, handler = server
    transport = OtlpTransport(url, token=None, timeout_s=1.0)
    handler.answer = (503, {"Retry-After": "7"}, b"busy")
    with pytest.raises(CollectorError) as busy:
        transport.send("/api/v1/ingest", _body())
    assert (busy.value.status, busy.value.retry_after) == (503, 7.0)  # retried after 7 s

    handler.answer = (400, {}, b'{"detail": "resource lacks trainwarden.run"}')
    with pytest.raises(CollectorError, match="lacks trainwarden.run") as refused:
        transport.send("/api/v1/ingest", _body())
    assert refused.value.status == 400  # dropped and counted, not retried
    transport.close()

    # Nothing listens: not a CollectorError, so the exporter keeps the batch and retries.
    nobody = OtlpTransport(f"http://127.0.0.1:{free_port()}", token=None, timeout_s=0.5)
    with pytest.raises(ConnectionError):
        nobody.send("/api/v1/ingest", _body())
    nobody.close()
