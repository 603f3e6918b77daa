"""The wire contract (agent/wire.py) as the relay, the exporter and the spool use it: on a
real loopback server, what the collector reads of a request."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainwarden.agent import wire
from trainwarden.agent.exporter import KEEPALIVE_S, HttpTransport
from trainwarden.agent.relay import Relay
from trainwarden.agent.spool import DiskSpool
from trainwarden.agent.stats import Stats
from trainwarden.collector.api.routes.ingest import RETRY_AFTER_S
from trainwarden.collector.cli import KEEP_ALIVE_S


class Upstream:
    """A stand-in collector on loopback: it keeps each request's path and headers."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        self.client_ports: list[int] = []  # each request's: one port, one connection
        seen, ports = self.seen, self.client_ports

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keeps a connection open, as uvicorn does

            def _answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.path, dict(self.headers), body))
                ports.append(self.client_address[1])
                reply = b'{"accepted_steps": 0, "accepted_events": 0}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = _answer  # noqa: N815 (the standard library's names)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


def test_what_the_relay_passes_through_says_it_came_through_the_relay(
    upstream: Upstream,
) -> None:
    with Relay(upstream.url, port=0) as relay:
        answer = httpx.get(relay.url + "/api/v1/runs", timeout=5)
        health = httpx.get(relay.url + wire.RELAY_HEALTH_PATH, timeout=5).json()
    assert answer.status_code == 200
    ((path, headers, _),) = upstream.seen
    assert path == "/api/v1/runs"
    # What the collector's ingest route looks for before it hints at a relay.
    assert "trainwarden-relay" in headers["Via"] and headers["Via"] == wire.RELAY_VIA
    assert health["upstream"] == upstream.url  # what an agent checks before using it


def test_an_agents_batch_through_the_relay_is_one_columnar_request(upstream: Upstream) -> None:
    body = {
        "run": "r1",
        "agent": {"rank": 3, "world_size": 8},
        "steps": [{"step": 1, "ts": 1.7e9, "duration_s": 0.5}],
        "events": [],
        "gpu": [],
    }
    with Relay(upstream.url, port=0, window_s=0.05) as relay:
        transport = HttpTransport(upstream.url, token=None, timeout_s=5, relay=relay.url)
        try:
            answer = transport.send(wire.INGEST_PATH, body)
        finally:
            transport.close()
    assert answer == {"accepted_steps": 1, "accepted_events": 0, "commands": []}
    ((path, headers, raw),) = upstream.seen
    assert path == wire.COLUMNS_PATH
    assert headers[wire.SENDER_HEADER] == "r1/3" == wire.sender(body)
    assert wire.loads(raw)["steps"]["step"] == [1]


def test_an_agent_sends_again_after_retry_after_on_the_connection_it_had(
    upstream: Upstream,
) -> None:
    # A refused request goes again after Retry-After (5 s); the connection must still be
    # open then (httpx's default closes one idle 5 s), and closed by the agent before
    # `trainwarden serve` closes it (20 s idle), never as the agent sends on it.
    assert float(RETRY_AFTER_S) < KEEPALIVE_S < KEEP_ALIVE_S
    body = {"run": "r1", "agent": {"rank": 0}, "steps": [], "events": [], "gpu": []}
    transport = HttpTransport(upstream.url, token=None, timeout_s=5)
    try:
        transport.send(wire.INGEST_PATH, body)
        time.sleep(float(RETRY_AFTER_S) + 0.5)
        transport.send(wire.INGEST_PATH, body)
    finally:
        transport.close()
    assert len(upstream.client_ports) == 2 and len(set(upstream.client_ports)) == 1


def test_the_spool_keeps_batches_in_the_wire_encoding(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path, max_bytes=1 << 20, stats=Stats())
    batch = ([{"step": 1, "loss": 2.5}], [{"id": "e", "kind": "start"}], [])
    spool.put(batch)
    (path,) = tmp_path.iterdir()
    assert path.read_bytes() == wire.dumps({"steps": batch[0], "events": batch[1], "gpu": []})
    assert json.loads(path.read_bytes())["steps"] == batch[0]
    assert spool.oldest() == (1, batch)


def test_the_sender_header_of_many_ranks() -> None:
    assert wire.ranks_header("r1", [0, 1, 2, 3, 5, 7, 6]) == "r1/0-3,5-7"
    assert wire.ranks_header("r1", [4]) == "r1/4"
