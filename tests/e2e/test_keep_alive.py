"""A sender refused with ``Retry-After`` comes back on the connection it had: ``serve``
keeps an idle keep-alive connection open longer than it asks senders to wait."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from trainwarden.collector.api.routes.ingest import RETRY_AFTER_S
from trainwarden.collector.cli import KEEP_ALIVE_S

from ..helpers import start_serve, stop_serve


def _get(sock: socket.socket, host: str) -> bytes:
    sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    return answer


def test_an_idle_connection_outlives_the_retry_after_it_asked_for(tmp_path: Path) -> None:
    assert 2 * float(RETRY_AFTER_S) < KEEP_ALIVE_S
    server = start_serve("sqlite:///" + str(tmp_path / "tw.db"), tmp_path / "serve.log")
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            assert _get(sock, host).startswith(b"HTTP/1.1 200")
            time.sleep(float(RETRY_AFTER_S) + 1.5)  # a refused node waits this, then sends
            again = _get(sock, host)
        # uvicorn's own default (5 s) had closed it by now: an empty answer.
        assert again.startswith(b"HTTP/1.1 200"), again
    finally:
        stop_serve(server)
