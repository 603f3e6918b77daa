"""``trainwarden serve`` with a stamp at each stage of every POST, for
``bench/request_stages.py``: its connection accepted, its first bytes parsed (uvicorn's
``on_message_begin``), the headers complete, the app called, the body read, the response
started and ended; and the server's event-loop lateness (a 100 ms timer). Written to
``$STAGES_OUT`` (JSON) every 3 s and at exit. It patches uvicorn's httptools protocol:
a measuring tool, not for serving.

    python bench/request_stages_serve.py serve --db URL --port N --auth off
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import sys
import threading
import time
from typing import Any

import uvicorn
from uvicorn.protocols.http import httptools_impl

OUT = os.environ.get("STAGES_OUT", "request-stages.json")
RECORDS: list[dict[str, Any]] = []
LAGS: list[tuple[float, float]] = []
_LOCK = threading.Lock()
_made = httptools_impl.HttpToolsProtocol.connection_made
_begin = httptools_impl.HttpToolsProtocol.on_message_begin
_headers = httptools_impl.HttpToolsProtocol.on_headers_complete


def connection_made(self: Any, transport: Any) -> None:
    self.stage_opened, self.stage_requests = time.time(), 0
    _made(self, transport)


def on_message_begin(self: Any) -> None:
    _begin(self)
    self.stage_requests += 1
    self.scope["stage_t0"] = time.time()
    self.scope["stage_opened"] = self.stage_opened
    self.scope["stage_nth"] = self.stage_requests  # 1: the connection's first request


def on_headers_complete(self: Any) -> None:
    self.scope["stage_headers"] = time.time()
    _headers(self)


httptools_impl.HttpToolsProtocol.connection_made = connection_made  # type: ignore[method-assign]
httptools_impl.HttpToolsProtocol.on_message_begin = on_message_begin  # type: ignore[method-assign]
httptools_impl.HttpToolsProtocol.on_headers_complete = on_headers_complete  # type: ignore[method-assign]


async def _lateness() -> None:
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + 0.1
        await asyncio.sleep(0.1)
        LAGS.append((time.time(), max(0.0, loop.time() - due)))


class Stages:
    """ASGI middleware, outermost in the app uvicorn serves: stamps each POST."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.timer: asyncio.Task[None] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.timer is None:
            self.timer = asyncio.get_running_loop().create_task(_lateness())
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        rec: dict[str, Any] = {
            "t0": scope.get("stage_t0"),
            "opened": scope.get("stage_opened"),
            "nth": scope.get("stage_nth"),
            "headers": scope.get("stage_headers"),
            "app": time.time(),
            "sender": (dict(scope["headers"]).get(b"x-trainwarden-sender") or b"").decode(),
        }

        async def receive_stamped() -> Any:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body"):
                rec["body"] = time.time()
            return message

        async def send_stamped(message: Any) -> None:
            if message["type"] == "http.response.start":
                rec["start"], rec["status"] = time.time(), message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                rec["end"] = time.time()

        try:
            await self.app(scope, receive_stamped, send_stamped)
        finally:
            RECORDS.append(rec)


def dump() -> None:
    with _LOCK:
        tmp = OUT + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"records": list(RECORDS), "lags": list(LAGS)}, f)
        os.replace(tmp, OUT)  # a reader never sees half a file


def _every_3_s() -> None:
    while True:
        time.sleep(3)
        dump()


_config_init = uvicorn.Config.__init__


def _init(self: Any, app: Any, *args: Any, **kwargs: Any) -> None:
    if "STAGES_KEEP_ALIVE_S" in os.environ:  # uvicorn's idle keep-alive timeout (5 s)
        kwargs["timeout_keep_alive"] = float(os.environ["STAGES_KEEP_ALIVE_S"])
    _config_init(self, Stages(app), *args, **kwargs)


uvicorn.Config.__init__ = _init  # type: ignore[method-assign]

if __name__ == "__main__":
    from trainwarden.collector.cli import main

    atexit.register(dump)
    threading.Thread(target=_every_3_s, daemon=True).start()
    main(sys.argv[1:])
