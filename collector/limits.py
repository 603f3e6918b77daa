"""Request body limit: a body over the limit gets 413 before it is parsed or stored."""

from __future__ import annotations

import json
from typing import Any


class BodyLimit:
    """Pure ASGI middleware: checks Content-Length, and counts chunked bodies as they come."""

    def __init__(self, app: Any, *, limit_bytes: int) -> None:
        self.app = app
        self.limit = limit_bytes

    async def _refuse(self, send: Any, size: str) -> None:
        body = json.dumps(
            {
                "error": f"request body {size} is over the {self.limit:,}-byte limit; send smaller batches"
            }
        )
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json")]})  # fmt: skip
        await send({"type": "http.response.body", "body": body.encode()})

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


class IngestBackpressure:
    """Pure ASGI middleware: at most ``limit`` ingest requests in progress. Past that a
    request is answered 503 with Retry-After at once, before its body is read, so a
    slow database slows agents down instead of growing the collector's memory."""

    def __init__(
        self, app: Any, *, limit: int, on_reject: Any = None, retry_after_s: int = 2
    ) -> None:
        self.app = app
        self.limit = limit
        self.inflight = 0
        self.on_reject = on_reject
        self.retry_after = str(retry_after_s).encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(INGEST_PATHS):
            await self.app(scope, receive, send)
            return
        if self.inflight >= self.limit:
            if self.on_reject is not None:
                self.on_reject()
            body = json.dumps(
                {"error": "collector busy: too many ingest requests in progress; retry later"}
            )
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", self.retry_after)]})  # fmt: skip
            await send({"type": "http.response.body", "body": body.encode()})
            return
        self.inflight += 1  # the event loop is single-threaded: no lock needed
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1
