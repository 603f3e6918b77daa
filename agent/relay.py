"""A node relay: the ranks of a node send their batches to it, and it sends the collector one
request for them all.

Every agent posts its rank's batch once a second (``POST /api/v1/ingest``). On a
16,384-GPU run that is 16,384 requests a second, and a collector spends far more on a
request than on the row in it (about 200 us against 30 on a 2-core machine: one collector
process takes ~3,500 single-row requests a second, and ~16,000 rows a second in requests of
eight). The relay runs once per node (``trainwarden relay``, or ``python -m
trainwarden.agent.relay``, standard library only) and listens where the node's agents send
(``TRAINWARDEN_RELAY=http://127.0.0.1:8470``). It holds each agent's request for a short
window (``--window``, 0.2 s; less once every rank it expects has sent), then sends the
collector one ``POST /api/v1/ingest/columns`` a run: the steps column-wise, the ranks'
headers, and the batches' events and GPU samples as ``extras``. Each agent then gets the
answer it would have had: its accepted counts and the commands waiting for its rank
(a rollback, a stop), which the collector returns per rank, or, for a rank another live
process holds, the collector's refusal of that rank alone (409, or 503 while it cannot
tell a restart from a duplicate: ``rank_refused``).

Nothing is lost on the way: the collector's refusal (503 with ``Retry-After``, 401/403)
is every held agent's own answer, so each keeps its batch and retries as it would have;
a 400, 413 or 422 for the merged request sends each held batch on its own, so only a bad
batch is refused; a collector out of reach is 503 to every agent. Requests the relay does
not merge (other paths, bodies it cannot read) pass through unchanged. And an agent whose
relay is down sends straight to the collector (``TRAINWARDEN_RELAY`` with
``TRAINWARDEN_URL``). The paths, headers (``Via: 1.1 trainwarden-relay`` on what it passes
through) and JSON encoding are the wire contract's (:mod:`.wire`).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from .wire import (
    COLUMNS_PATH,
    INGEST_PATH,
    RELAY_HEALTH_PATH,
    RELAY_NAME,
    RELAY_VIA,
    SENDER_HEADER,
    dumps,
    loads,
    ranks_header,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 8470
DEFAULT_WINDOW_S = 0.2
MAX_BODY_BYTES = 64 << 20  # what one agent may send the relay (the collector's own limit decides)
MAX_HELD = 4096  # batches held at once; past it an agent is told 503 (its batch kept, resent)
# Forwarded as they came: what the collector reads from an agent's request.
_PASSED_HEADERS = ("Authorization", "Content-Type", SENDER_HEADER, "User-Agent")


@dataclass
class Answer:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class _Held:
    """One agent's request, held until the merged request's answer."""

    raw: bytes
    body: dict[str, Any]
    headers: dict[str, str]
    arrived: float
    done: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None

    @property
    def rank(self) -> int:
        return int(self.body["agent"]["rank"])

    def reply(self, answer: Answer) -> None:
        self.answer = answer
        self.done.set()


def _mergeable(body: Any) -> bool:
    """A batch the relay can put in a columnar request (else it passes through as sent)."""
    if not isinstance(body, dict) or not isinstance(body.get("run"), str):
        return False
    agent = body.get("agent")
    if not isinstance(agent, dict) or type(agent.get("rank")) is not int:
        return False
    if type(agent.get("world_size")) is not int:
        return False
    for key in ("steps", "events", "gpu"):
        items = body.get(key, [])
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            return False
    return set(body) <= {"run", "agent", "steps", "events", "gpu"}


def columnar(held: Sequence[_Held]) -> dict[str, Any]:
    """One run's held batches as one ``ColumnarBatch`` body: steps column-wise, each rank's
    newest header, and the batches with events or GPU samples as ``extras``."""
    run = held[0].body["run"]
    heads: dict[int, dict[str, Any]] = {}
    rows: list[tuple[int, dict[str, Any]]] = []
    extras = []
    for h in held:  # in arrival order: a rank's later header wins
        agent = h.body["agent"]
        heads[agent["rank"]] = agent
        rows += [(agent["rank"], step) for step in h.body.get("steps", ())]
        if h.body.get("events") or h.body.get("gpu"):
            extras.append(
                {
                    "run": run,
                    "agent": agent,
                    "events": h.body.get("events", []),
                    "gpu": h.body.get("gpu", []),
                }
            )
    names: dict[str, None] = {}
    for _, step in rows:
        names.update(dict.fromkeys(step))
    steps: dict[str, list[Any]] = {}
    if rows:
        steps["rank"] = [rank for rank, _ in rows]
        for name in names:
            steps[name] = [step.get(name) for _, step in rows]
    body: dict[str, Any] = {
        "run": run,
        "world_size": max(a["world_size"] for a in heads.values()),
        "steps": steps,
    }
    agents = list(heads.values())
    keys = set(agents[0])
    if all(set(a) == keys for a in agents):  # the usual: headers column-wise, cheaper to check
        body["agent_columns"] = {k: [a[k] for a in agents] for k in agents[0] if k != "world_size"}
    else:
        body["agents"] = agents
    if extras:
        body["extras"] = extras
    return body


def _refusal(no: dict[str, Any]) -> Answer:
    """A rank whose rows the collector refused (``rank_refused``: another process holds
    it, 409; or it cannot tell yet, 503): the answer it would have had on its own."""
    body = {k: v for k, v in no.items() if k != "status"}
    headers = {"Content-Type": "application/json"}
    if "retry_after" in body:
        headers["Retry-After"] = str(body["retry_after"])
    return Answer(int(no.get("status", 409)), dumps(body), headers)


class _Upstream:
    """One keep-alive connection to the collector (used by one thread at a time)."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"collector url {url!r} is not valid: use http://host:port or https://host"
            )
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            self._conn = cls(self.host, self.port, timeout=self.timeout_s)
        return self._conn

    def request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Answer:
        """Send one request; a stale keep-alive connection is opened again once."""
        for attempt in (0, 1):
            conn = self._connect()
            try:
                conn.request(method, self.prefix + path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            except (http.client.HTTPException, OSError):
                self.close()
                if attempt:
                    raise
                continue
            keep = {
                k: v
                for k, v in response.getheaders()
                if k.lower() in ("retry-after", "content-type")
            }
            if response.will_close:
                self.close()
            return Answer(response.status, data, keep)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _unreachable(exc: BaseException) -> Answer:
    detail = f"trainwarden relay: the collector is out of reach ({exc}); send again later"
    return Answer(
        503, dumps({"detail": detail}), {"Retry-After": "2", "Content-Type": "application/json"}
    )


class Relay:
    """The relay's server and its forwarding thread. ``expect``: how many ranks send here
    (the node's GPUs); once that many have sent, the window closes early. ``job``: the key
    of the job it serves, which its health answer names (``relay="auto"``)."""

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        window_s: float = DEFAULT_WINDOW_S,
        expect: int | None = None,
        timeout_s: float = 30.0,
        job: str | None = None,
    ) -> None:
        if not 0 < window_s <= 10:
            raise ValueError(f"window {window_s} s: from 0 to 10 seconds")
        if expect is not None and expect < 1:
            raise ValueError(f"expect {expect}: at least 1 rank")
        self.upstream_url = upstream.rstrip("/")
        self._upstream = _Upstream(self.upstream_url, timeout_s)  # checks the URL
        self.window_s = window_s
        self.expect = expect
        self.job = job  # relay="auto": the job whose ranks send here (agent/node_relay.py)
        self.timeout_s = timeout_s
        self.stats = {
            "held": 0,
            "merged_requests": 0,
            "passed_through": 0,
            "one_by_one": 0,
            "refused": 0,
        }
        self._pending: list[_Held] = []
        self._conns: set[socket.socket] = set()  # the agents' open connections
        self._cond = threading.Condition()
        self._stopping = False
        relay = self

        class Handler(_Handler):
            owner = relay

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Relay:
        for target, name in (
            (self._server.serve_forever, "trainwarden-relay-http"),
            (self._forward_loop, "trainwarden-relay-forward"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Send what is held, then stop: the agents' open connections are closed, so that
        they go to the collector directly (a request arriving meanwhile is passed on)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._server.shutdown()
        for t in self._threads:
            t.join(self.timeout_s + 5)
        with self._cond:
            open_conns, self._conns = list(self._conns), set()
        for conn in open_conns:  # keep-alive connections' handler threads outlive the server
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._server.server_close()
        self._upstream.close()

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- held requests ---------------------------------------------------------------

    def hold(self, held: _Held) -> Answer:
        if self._stopping:  # no merged request will go out: this one on its own
            return self.pass_through("POST", INGEST_PATH, held.raw, held.headers)
        with self._cond:
            if len(self._pending) >= MAX_HELD:
                self.stats["refused"] += 1
                return Answer(
                    503,
                    dumps({"detail": "trainwarden relay: busy; send again later"}),
                    {"Retry-After": "1", "Content-Type": "application/json"},
                )
            self._pending.append(held)
            self.stats["held"] += 1
            self._cond.notify_all()
        if not held.done.wait(self.window_s + 2 * self.timeout_s + 5) or held.answer is None:
            return _unreachable(TimeoutError("no answer in time"))
        return held.answer

    def _due(self) -> bool:
        if self._stopping:
            return True
        if time.monotonic() - self._pending[0].arrived >= self.window_s:
            return True
        return self.expect is not None and len({h.rank for h in self._pending}) >= self.expect

    def _forward_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if not self._pending and self._stopping:
                    return
                while not self._due():
                    left = self.window_s - (time.monotonic() - self._pending[0].arrived)
                    self._cond.wait(max(left, 0.001))
                taken, self._pending = self._pending, []
            groups: dict[tuple[str, str], list[_Held]] = {}
            for h in taken:
                groups.setdefault((h.body["run"], h.headers.get("Authorization", "")), []).append(h)
            for group in groups.values():
                try:
                    self._forward(group)
                except Exception as exc:  # never leave an agent waiting
                    log.exception("trainwarden relay: forwarding failed")
                    for h in group:
                        if not h.done.is_set():
                            h.reply(_unreachable(exc))

    def _forward(self, group: list[_Held]) -> None:
        body = columnar(group)
        headers = {
            "Content-Type": "application/json",
            SENDER_HEADER: ranks_header(body["run"], [h.rank for h in group]),
        }
        if group[0].headers.get("Authorization"):
            headers["Authorization"] = group[0].headers["Authorization"]
        try:
            answer = self._upstream.request("POST", COLUMNS_PATH, dumps(body), headers)
        except (http.client.HTTPException, OSError) as exc:
            for h in group:
                h.reply(_unreachable(exc))
            return
        self.stats["merged_requests"] += 1
        if answer.status in (400, 413, 422) and len(group) > 1:
            # One bad batch must not cost the others theirs: each goes on its own, and
            # only what the collector refuses is refused.
            self.stats["one_by_one"] += 1
            for h in group:
                h.reply(self.pass_through("POST", INGEST_PATH, h.raw, h.headers))
            return
        if answer.status != 200:
            for h in group:
                h.reply(answer)
            return
        try:
            said = loads(answer.body)
            by_rank = said.get("rank_commands") or {}
            refused = said.get("rank_refused") or {}
        except ValueError:
            by_rank, refused = {}, {}
        last = {h.rank: h for h in group}  # a rank's commands go to its newest batch
        for h in group:
            if (no := refused.get(str(h.rank))) is not None:
                h.reply(_refusal(no))  # another process holds the rank: its own answer
                continue
            steps = h.body.get("steps", ())
            result = {
                "accepted_steps": len({s.get("step") for s in steps}),
                "accepted_events": len(h.body.get("events", ())),
                "commands": by_rank.get(str(h.rank), []) if last[h.rank] is h else [],
            }
            h.reply(Answer(200, dumps(result), {"Content-Type": "application/json"}))

    def pass_through(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> Answer:
        """Send one request on as it came, on a connection of its own."""
        self.stats["passed_through"] += 1
        upstream = _Upstream(self.upstream_url, self.timeout_s)
        try:
            return upstream.request(method, path, body, {**headers, "Via": RELAY_VIA})
        except (http.client.HTTPException, OSError) as exc:
            return _unreachable(exc)
        finally:
            upstream.close()


class _Handler(BaseHTTPRequestHandler):
    owner: Relay
    protocol_version = "HTTP/1.1"  # keep-alive: an agent's httpx client keeps its connection
    server_version = RELAY_NAME

    def setup(self) -> None:
        super().setup()
        with self.owner._cond:
            self.owner._conns.add(self.connection)

    def finish(self) -> None:
        with self.owner._cond:
            self.owner._conns.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("relay: " + format, *args)

    def _headers(self) -> dict[str, str]:
        return {k: v for k in _PASSED_HEADERS if (v := self.headers.get(k)) is not None}

    def _send(self, answer: Answer) -> None:
        self.send_response(answer.status)
        for k, v in answer.headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(answer.body)))
        self.end_headers()
        self.wfile.write(answer.body)

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            detail = f"trainwarden relay: body of {length} bytes; at most {MAX_BODY_BYTES}"
            self._send(Answer(413, dumps({"detail": detail}), {"Content-Type": "application/json"}))
            return
        raw = self.rfile.read(length)
        path = self.path.split("?", 1)[0]
        body: Any = None
        if path == INGEST_PATH:
            try:
                body = loads(raw)
            except ValueError:
                body = None
        if path != INGEST_PATH or not _mergeable(body):
            self._send(self.owner.pass_through("POST", self.path, raw, self._headers()))
            return
        self._send(self.owner.hold(_Held(raw, body, self._headers(), time.monotonic())))

    def do_GET(self) -> None:  # noqa: N802
        if self.path == RELAY_HEALTH_PATH:
            stats = {
                "status": "ok",
                "upstream": self.owner.upstream_url,
                "job": self.owner.job,
                **self.owner.stats,
            }
            self._send(Answer(200, dumps(stats), {"Content-Type": "application/json"}))
            return
        self._send(self.owner.pass_through("GET", self.path, None, self._headers()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--upstream", required=True, help="the collector's URL (as agents' TRAINWARDEN_URL)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument(
        "--window",
        type=float,
        default=DEFAULT_WINDOW_S,
        help=f"seconds a batch waits for the node's others (default {DEFAULT_WINDOW_S})",
    )
    p.add_argument(
        "--expect",
        type=int,
        default=None,
        help="ranks that send here (the node's GPUs): once all have sent, send at once",
    )


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; then send what is held and stop."""
    relay = Relay(
        args.upstream, host=args.host, port=args.port, window_s=args.window, expect=args.expect
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    relay.start()
    print(
        f"trainwarden relay: {relay.url} -> {relay.upstream_url} (window {relay.window_s} s)",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        relay.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainwarden.agent.relay", description=__doc__.split("\n\n")[0]
    )
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        return run(args)
    except (ValueError, OSError) as exc:
        print(f"trainwarden relay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
