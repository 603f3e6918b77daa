"""Request body limit (413 before a body is parsed or stored), ingest backpressure (503
past a number of requests in progress) and the pressure record the health evaluator
reads to tell a busy collector from a silent rank."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainwarden.agent import wire

SENDER_HEADER = wire.SENDER_HEADER.lower().encode()  # RUN/RANKS, sent by agents and loadgen
MAX_SENDER_RANKS = 4096  # ranks one refused request may vouch for
MAX_HEARD = 1 << 18  # (run, rank) pairs remembered (~25 MB); past it the old ones go


def sender_ranks(value: str) -> tuple[str, list[int]] | None:
    """``RUN/RANKS`` (``run-a/3``, ``run-a/0-7``, ``run-a/0,2,4-6``) as (run, ranks);
    None for anything else: a malformed header is ignored, never an error."""
    run, sep, spec = value.partition("/")
    if not sep or not run or len(run) > 128 or not spec:
        return None
    ranks: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            return None
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo or len(ranks) + hi - lo + 1 > MAX_SENDER_RANKS:
            return None
        ranks.extend(range(lo, hi + 1))
    return run, ranks


@dataclass(frozen=True)
class Elsewhere:
    """What the other collectors on the database last said of their pressure
    (``pressure_board``): the latest time one fell behind (epoch seconds), the largest
    delay among those that said so lately, the ranks they refused, when, and when the
    oldest of what was read was said (``said_at``; inf: nothing was)."""

    behind_at: float = float("-inf")
    lag_s: float = 0.0
    heard: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    said_at: float = float("inf")


class Pressure:
    """When the collector last fell behind on its ingest (refused a request with 503, or
    let requests wait longer than ``behind_s``), and which ranks it turned away.

    For ``memory_s`` after it fell behind, the health evaluator allows for ranks arriving
    later than their heartbeat; a collector that is keeping up and still hears late from
    a rank blames the rank. A refused request that names its sender (``SENDER_HEADER``)
    is a heartbeat: its ranks are alive, whatever the collector could take.

    With several collectors on one database, ``elsewhere`` is what the others said
    (``pressure_board`` replaces it twice a second): the answers below count their
    refusals and delays too, since any collector may lead the pass that asks."""

    def __init__(
        self, lag: Callable[[], float], *, behind_s: float = 1.0, memory_s: float = 30.0
    ) -> None:
        self._lag = lag
        self.behind_s = behind_s
        self.memory_s = memory_s
        self._at = float("-inf")  # time.monotonic() of the last sign
        self._heard: dict[str, dict[int, float]] = {}  # run -> rank -> when refused (time.time())
        self._pairs = 0
        self._lock = threading.Lock()  # refused on the event loop, heard by the health thread
        self.elsewhere = Elsewhere()

    def refused(self, sender: str | None = None) -> None:
        """An ingest request was answered 503; ``sender``: its header, if it had one."""
        self._at = time.monotonic()
        who = sender_ranks(sender) if sender else None
        if who is None:
            return
        run, ranks = who
        now = time.time()
        with self._lock:
            heard = self._heard.setdefault(run, {})
            before = len(heard)
            heard.update(dict.fromkeys(ranks, now))
            self._pairs += len(heard) - before
            if self._pairs > MAX_HEARD:  # a bound on memory whatever senders claim
                self._forget(now)

    def _forget(self, now: float) -> None:
        cutoff = now - self.memory_s
        for run in list(self._heard):
            kept = {r: t for r, t in self._heard[run].items() if t >= cutoff}
            if kept:
                self._heard[run] = kept
            else:
                del self._heard[run]
        self._pairs = sum(map(len, self._heard.values()))
        if self._pairs > MAX_HEARD // 2:
            self._heard, self._pairs = {}, 0

    def heard(self, run: str) -> dict[int, float]:
        """When each of the run's ranks last sent a request this collector, or another on
        its database, refused."""
        with self._lock:
            heard = dict(self._heard.get(run, {}))
        for rank, at in self.elsewhere.heard.get(run, {}).items():
            if at > heard.get(rank, float("-inf")):
                heard[rank] = at
        return heard

    def _own_lag(self) -> float:
        """This collector's delay now (its ``lag``), noted when past ``behind_s``."""
        lag = self._lag()
        if lag > self.behind_s:
            self._at = time.monotonic()
        return lag

    def lag_s(self) -> float:
        """The collector's delay now; or another collector's, when one has something to
        say, plus how old what it said is: a rank it refused since may not be known here
        yet."""
        other = self.elsewhere
        news = max(0.0, time.time() - other.said_at) if other.said_at != float("inf") else 0.0
        return max(self._own_lag(), other.lag_s + news)

    def pressed(self) -> bool:
        """Whether this collector, or another on its database, fell behind in the last
        ``memory_s``."""
        self._own_lag()
        return (
            time.monotonic() - self._at < self.memory_s
            or time.time() - self.elsewhere.behind_at < self.memory_s
        )

    def own(self) -> tuple[float | None, float, dict[str, dict[int, float]]]:
        """What this collector has to tell the others: when it last fell behind (epoch
        seconds; None: not in the last ``memory_s``), its delay now, and the ranks it
        refused in the last ``memory_s``, when."""
        lag = self._own_lag()
        now, since = time.time(), time.monotonic() - self._at
        cutoff = now - self.memory_s
        with self._lock:
            heard = {
                run: {rank: at for rank, at in ranks.items() if at >= cutoff}
                for run, ranks in self._heard.items()
            }
        return (
            now - since if since < self.memory_s else None,
            lag,
            {run: ranks for run, ranks in heard.items() if ranks},
        )


async def json_response(
    send: Any, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """A whole JSON answer from an ASGI middleware, with its length: without one the
    server sends it chunked, which a minimal HTTP client (the load generator) misreads."""
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + list(headers)})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """Pure ASGI middleware: checks Content-Length, and counts chunked bodies as they come."""

    def __init__(self, app: Any, *, limit_bytes: int) -> None:
        self.app = app
        self.limit = limit_bytes

    async def _refuse(self, send: Any, size: str) -> None:
        body = json.dumps(
            {
                "error": f"request body {size} is over the {self.limit:,}-byte limit; send "
                "smaller batches"
            }
        )
        await json_response(send, 413, body.encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send, f"of {int(declared):,} bytes")
            return
        seen = 0
        started = refused = False

        async def counted() -> Any:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit and not started:
                    # Answer now and let the app see the client go: nothing is parsed or stored.
                    refused = True
                    await self._refuse(send, "(streamed)")
                    return {"type": "http.disconnect"}
            return message

        async def watched(message: Any) -> None:
            nonlocal started
            if refused:
                return  # we answered already
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted, watched)


INGEST_PATHS = ("/api/v1/ingest", "/v1/metrics")  # native and OTLP


class InFlight:
    """How many ingest requests are past the gate and not yet answered."""

    n = 0


class IngestBackpressure:
    """Pure ASGI middleware: at most ``limit`` ingest requests in progress. Past that a
    request is answered 503 with Retry-After at once, before its body is read, so a
    slow database slows agents down instead of growing the collector's memory."""

    def __init__(
        self,
        app: Any,
        *,
        limit: int,
        on_reject: Any = None,
        retry_after_s: int = 2,
        inflight: InFlight | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.count = inflight if inflight is not None else InFlight()  # /metrics reads it
        self.on_reject = on_reject
        self.retry_after = str(retry_after_s).encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(INGEST_PATHS):
            await self.app(scope, receive, send)
            return
        count = self.count
        if count.n >= self.limit:
            if self.on_reject is not None:
                sender = next((v for k, v in scope["headers"] if k == SENDER_HEADER), None)
                self.on_reject(sender.decode("latin-1") if sender is not None else None)
            body = json.dumps(
                {"error": "collector busy: too many ingest requests in progress; retry later"}
            )
            await json_response(send, 503, body.encode(), [(b"retry-after", self.retry_after)])
            return
        count.n += 1  # the event loop is single-threaded: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            count.n -= 1
