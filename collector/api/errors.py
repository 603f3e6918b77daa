"""The API's error answers, in one place: every domain error (``store.errors``) becomes
its status code and body, and so do FastAPI's own (``HTTPException``, request validation).

The bodies: a 422 is ``{"error": "field: what is wrong", "detail": [{"loc", "msg",
"type"}, ...]}`` (the ``detail`` list when a field is at fault), anything else
``{"detail": "what is wrong"}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from trainwarden.collector.store.errors import DomainError


def _location(loc: tuple[object, ...] | list[object]) -> str:
    """Where in the request: ``("body", "steps", "3", "loss")`` -> ``steps[3].loss``."""
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for part in parts:
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out or "body"


def domain_body(exc: DomainError) -> dict[str, Any]:
    """The answer's body for a domain error (the web UI shows its message)."""
    if exc.status_code != 422:
        return {"detail": str(exc)}
    loc = getattr(exc, "loc", None)
    if not loc:
        return {"error": str(exc)}
    detail = [{"loc": list(loc), "msg": str(exc), "type": "value_error"}]
    return {"error": f"{loc[-1]}: {exc}", "detail": detail}


def install(app: FastAPI, *, on_invalid: Callable[[Request], None] | None = None) -> None:
    """Register the handlers; ``on_invalid`` is told of each request that failed
    validation (the collector counts refused ingest requests)."""

    @app.exception_handler(DomainError)
    async def _domain(_request: Request, exc: DomainError) -> JSONResponse:
        return JSONResponse(domain_body(exc), status_code=exc.status_code)

    @app.exception_handler(HTTPException)
    async def _http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        body = {"error": exc.detail} if exc.status_code == 422 else {"detail": exc.detail}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if on_invalid is not None:
            on_invalid(request)
        summary = "; ".join(f"{_location(e['loc'])}: {e['msg']}" for e in errors[:5])
        detail = [{k: e[k] for k in ("loc", "msg", "type") if k in e} for e in errors]
        return JSONResponse({"error": summary, "detail": detail}, status_code=422)
