"""Real receivers for alert notifications: a local HTTP server that records what it gets
and answers as told (standing in for PagerDuty, Slack and webhooks), and Alertmanager
itself on loopback."""

from __future__ import annotations

import json
import subprocess
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from .net import free_port

ALERTMANAGER = Path("/usr/bin/prometheus-alertmanager")


# -- a local HTTP receiver ---------------------------------------------------------------


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: Any
    at: float = 0.0  # arrival, epoch seconds


class Receiver:
    """Records every POST; answers each path from its script (a status; "slow": 200 after
    0.3 s; "hang": no answer until the test ends), then 200. ``log`` has each request's
    arrival and answer in order ("got firing", "answered firing")."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.log: list[str] = []
        self.scripts: dict[str, list[int | str]] = {}
        self.released = threading.Event()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status = body.get("status") if isinstance(body, dict) else None
                with receiver._lock:
                    receiver.requests.append(
                        Request(self.path, dict(self.headers), body, time.time())
                    )
                    receiver.log.append(f"got {status}")
                    script = receiver.scripts.get(self.path, [])
                    answer = script.pop(0) if script else 200
                if answer == "hang":
                    receiver.released.wait(60)
                    return
                if answer == "slow":
                    time.sleep(0.3)
                    answer = 200
                assert isinstance(answer, int)
                reply = b'{"status": "success"}' if answer < 300 else b"bad day\nat the receiver"
                self.send_response(answer)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
                self.wfile.flush()
                with receiver._lock:
                    receiver.log.append(f"answered {status}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
        self.server.daemon_threads = True
        self.server.request_queue_size = 128  # the default 5 drops a burst's connections
        self.server.server_bind()
        self.server.server_activate()
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def answer(self, path: str, *answers: int | str) -> None:
        with self._lock:
            self.scripts[path] = list(answers)

    def got(self, path: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def running_alertmanager(tmp_path: Path, webhook_url: str) -> Iterator[str]:
    """Alertmanager on loopback, routing everything to ``webhook_url`` within ~1 s.
    Missing binary: the test FAILS (never skips) and says what to install."""
    if not ALERTMANAGER.exists():
        pytest.fail(
            f"ALERTMANAGER MISSING: {ALERTMANAGER} not found; install Debian's "
            "prometheus-alertmanager package (scripts/test.sh does)",
            pytrace=False,
        )
    (tmp_path / "alertmanager.yml").write_text(
        textwrap.dedent(f"""\
        route:
          receiver: hook
          group_by: ['...']
          group_wait: 1s
          group_interval: 1s
          repeat_interval: 1h
        receivers:
          - name: hook
            webhook_configs:
              - url: {webhook_url}
                send_resolved: true
        """)
    )
    port = free_port()
    log = tmp_path / "alertmanager.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                str(ALERTMANAGER),
                f"--config.file={tmp_path / 'alertmanager.yml'}",
                f"--storage.path={tmp_path / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                pytest.fail(f"alertmanager exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"alertmanager not ready after 30 s: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
