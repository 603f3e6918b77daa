"""What the collector's ASGI layers cost an ingest request, in process, with no socket.

Builds the app as ``serve`` does (on a throwaway SQLite file, no UI), replaces the ingest
route's work with a trivial answer (the body read, a fixed JSON reply), and calls the
same POST ``/api/v1/ingest`` many times at three depths: the whole app (Starlette's and
FastAPI's own layers, then ours), our layers only (backpressure, body limit, the direct
route), and the direct route alone. The differences are what each part of the stack
costs a request; what a real request costs beyond them is uvicorn, the socket, and the
route's own work (parse, validate, the writer), which bench/ingest.py measures.

    python bench/asgi_layers.py [--requests 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from trainwarden.agent import wire
from trainwarden.collector.api.routes.ingest import DirectIngest
from trainwarden.collector.app import create_app
from trainwarden.collector.settings import Settings
from trainwarden.collector.store.db import make_engine, upgrade

BODY = b'{"run": "r"}'


def _scope(app: Any) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": wire.INGEST_PATH,
        "raw_path": wire.INGEST_PATH.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"collector"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
        "app": app,
    }


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": BODY, "more_body": False}


async def _send(message: dict[str, Any]) -> None:
    return None


async def _trivial(request: Request) -> Response:
    await request.body()
    return Response(b'{"accepted_steps": 1}', media_type="application/json")


def _layers(app: Any) -> list[Any]:
    """The built middleware stack, outermost first, down to the router."""
    out, layer = [], app.middleware_stack
    while layer is not None:
        out.append(layer)
        layer = getattr(layer, "app", None)
    return out


async def _measure(requests: int, rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'layers.db'}"
        engine = make_engine(url)
        upgrade(engine)
        app = create_app(engine, Settings(db=url, auth="off"), ui=False)
        await app(_scope(app), _receive, _send)  # Starlette builds its stack on the first call
        layers = _layers(app)
        print("the stack:", " -> ".join(type(layer).__name__ for layer in layers))
        direct = next(layer for layer in layers if isinstance(layer, DirectIngest))
        direct.routes = {**direct.routes, wire.INGEST_PATH: _trivial}
        names = [type(layer).__name__ for layer in layers]
        ours = layers[names.index("IngestBackpressure")]
        depths = (("the whole app", app), ("our layers only", ours), ("the direct route", direct))
        for _ in range(rounds):
            for name, target in depths:
                started = time.process_time()
                for _ in range(requests):
                    await target(_scope(app), _receive, _send)
                cost = (time.process_time() - started) / requests * 1e6
                print(f"  {name:18s} {cost:6.1f} us of CPU a request")
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(_measure(args.requests, args.rounds))


if __name__ == "__main__":
    main()
