"""Who may do what: bearer tokens with scopes, UI sessions, a trusted proxy header.

One pure ASGI middleware (:class:`AuthMiddleware`) decides every request before any
route runs, by path and method:

- ``POST /api/v1/ingest``, ``/api/v1/ingest/columns``, ``/v1/metrics``: ``ingest``
  (and the run in the body must match the token's pattern: :func:`check_run`);
- any other ``GET`` under ``/api/v1``: ``read``; any other method there: ``admin``;
- ``/healthz``, ``/metrics`` (unless ``metrics_scope``), ``/runbooks``, ``/docs``,
  ``/openapi.json``, ``/login``, ``/logout``: open;
- everything else is the web UI: a session cookie (``/login``), the trusted proxy
  header when configured, or a bearer token with ``read``.

The principal is kept in a context variable for the request. The UI changes things
through the same services as the routes, in-process (``webui/client.py``), so it calls
:func:`check_admin` as the write routes do (``api/deps.admin``): a UI session with only
``read`` sees, and is refused changes.

One concept in one module of some 500 lines: the middleware, the tokens' cache, sessions
and the login page decide together who a request is.

The hot path (ingest, thousands of requests a second) costs a dict look-up, one
sha256 and a constant-time compare: tokens are cached for ``cache_ttl_s`` (so a
revocation takes effect within it), and ``last_used_at`` is written with the next
refresh, at most every ``last_used_every_s``.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import hmac
import html
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import Engine

from trainwarden.collector.ingest.limits import json_response
from trainwarden.collector.store import tokens
from trainwarden.collector.store.tokens import Principal

log = logging.getLogger(__name__)

current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "trainwarden_principal", default=None
)
SESSION_COOKIE = "tw_session"
INGEST_PATHS = ("/api/v1/ingest", "/api/v1/ingest/columns", "/v1/metrics")
OPEN_PATHS = ("/healthz", "/login", "/logout", "/docs", "/redoc", "/openapi.json", "/favicon.ico")


@dataclass
class AuthSettings:
    """How ``serve`` checks requests (``serve --auth required``, the default)."""

    trusted_user_header: str | None = None
    """A header an authenticating reverse proxy sets to the user's name (e.g.
    ``X-Forwarded-User``): UI requests carrying it are that user. Only safe when the
    proxy overwrites it and nothing reaches the collector except through the proxy."""
    trusted_user_scope: Literal["read", "admin"] = "admin"
    """What a user named by the trusted header may do in the UI."""
    cache_ttl_s: float = 5.0
    """How long a token's row is trusted before it is read again: a revocation is
    honoured within this."""
    last_used_every_s: float = 60.0
    """``last_used_at`` is written at most this often per token."""
    rate_per_s: float = 2000.0
    """Requests a second each token may make, on average; 0: no limit."""
    burst: int = 10_000
    """Requests a token may make at once above its rate."""
    session_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    """Signs UI session cookies. Random per process unless given (give the same one
    to every replica behind a load balancer, or sessions end at a restart)."""
    session_max_age_s: float = 12 * 3600
    metrics_scope: Literal["read"] | None = None
    """``read``: ``/metrics`` needs a token with ``read`` too (default: open)."""

    def __post_init__(self) -> None:
        if self.rate_per_s < 0 or self.burst < 1:
            raise ValueError("rate_per_s must be >= 0 and burst >= 1")
        if self.cache_ttl_s < 0:
            raise ValueError("cache_ttl_s must be >= 0")


class Authenticator:
    """Checks tokens against the database through a small cache with a short TTL."""

    MAX_CACHED = 10_000  # unknown ids are cached too: a flood of them is bounded

    def __init__(self, engine: Engine, settings: AuthSettings) -> None:
        self.engine = engine
        self.settings = settings
        # token id -> (valid until, secret hash or None, principal or None)
        self._cache: dict[str, tuple[float, str | None, Principal | None]] = {}
        self._used: dict[str, float] = {}  # token id -> last use (wall clock), not yet written
        self._written: dict[str, float] = {}  # token id -> when last_used_at was last written
        self._buckets: dict[str, list[float]] = {}  # token id -> [tokens left, at]
        self._pending: dict[str, asyncio.Future[tuple[str | None, Principal | None]]] = {}

    def cached(self, token_id: str) -> tuple[str | None, Principal | None] | None:
        """(hash, principal) from the cache, or None when it must be read (no I/O here)."""
        entry = self._cache.get(token_id)
        if entry is None or entry[0] < time.monotonic():
            return None
        return entry[1], entry[2]

    def refresh(self, token_id: str) -> tuple[str | None, Principal | None]:
        """Read a token's row (blocking: run off the event loop), and write last-use times."""
        try:
            row = tokens.find(self.engine, token_id)
        except Exception as exc:
            raise _Unavailable() from exc
        found = (row.secret_hash, tokens.principal_of(row)) if row is not None else (None, None)
        if len(self._cache) >= self.MAX_CACHED:
            self._cache.clear()
        self._cache[token_id] = (time.monotonic() + self.settings.cache_ttl_s, *found)
        self._write_last_used()
        return found

    def _write_last_used(self) -> None:
        now = time.time()
        due = {
            tid: at
            for tid, at in list(self._used.items())
            if now - self._written.get(tid, 0.0) >= self.settings.last_used_every_s
        }
        if not due:
            return
        try:
            tokens.touch(self.engine, last_used=due)
        except Exception as exc:  # a busy database: try with the next refresh
            log.warning("trainwarden: cannot record token use: %s", str(exc).splitlines()[0])
            return
        for tid in due:
            self._written[tid] = now
            self._used.pop(tid, None)

    @staticmethod
    def match(raw_secret: str, found: tuple[str | None, Principal | None]) -> Principal | None:
        secret_hash, principal = found
        if secret_hash is None or principal is None:
            return None
        given = tokens.hash_secret(raw_secret)
        return principal if hmac.compare_digest(given, secret_hash) else None

    async def verify(self, raw: str) -> Principal | None:
        """The principal of a bearer token; None for a malformed, unknown or revoked one."""
        parts = tokens.split_token(raw)
        if parts is None:
            return None
        token_id, secret = parts
        found = self.cached(token_id) or await self._read(token_id)
        principal = self.match(secret, found)
        if principal is not None:
            self._used[token_id] = time.time()
        return principal

    async def by_id(self, token_id: str) -> Principal | None:
        """A live token's principal by id alone (a signed session already proved it)."""
        found = self.cached(token_id) or await self._read(token_id)
        return found[1]

    async def _read(self, token_id: str) -> tuple[str | None, Principal | None]:
        """One database read per token at a time: when its entry expires under load, the
        requests that arrive meanwhile wait for that read instead of each making one."""
        pending = self._pending.get(token_id)
        if pending is None:
            pending = asyncio.ensure_future(asyncio.to_thread(self.refresh, token_id))
            self._pending[token_id] = pending
            pending.add_done_callback(lambda _: self._pending.pop(token_id, None))
        return await asyncio.shield(pending)

    def take(self, token_id: str) -> float:
        """Token bucket: 0 when the request may go, else seconds until it may."""
        rate, burst = self.settings.rate_per_s, float(self.settings.burst)
        if rate <= 0:
            return 0.0
        now = time.monotonic()
        bucket = self._buckets.setdefault(token_id, [burst, now])
        bucket[0] = min(burst, bucket[0] + (now - bucket[1]) * rate)
        bucket[1] = now
        if bucket[0] >= 1.0:
            bucket[0] -= 1.0
            return 0.0
        return (1.0 - bucket[0]) / rate

    # -- UI sessions: a signed cookie naming the token it was made with -------------

    def session_cookie(self, principal: Principal) -> str:
        payload = json.dumps(
            {"t": principal.token_id, "exp": time.time() + self.settings.session_max_age_s}
        ).encode()
        data = base64.urlsafe_b64encode(payload).decode().rstrip("=")
        return f"{data}.{self._sign(data)}"

    def _sign(self, data: str) -> str:
        return hmac.new(self.settings.session_secret, data.encode(), hashlib.sha256).hexdigest()

    async def session(self, cookie: str) -> Principal | None:
        data, _, signature = cookie.partition(".")
        if not hmac.compare_digest(signature, self._sign(data)):
            return None
        try:
            payload = json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
            token_id, expires = str(payload["t"]), float(payload["exp"])
        except (ValueError, KeyError, TypeError):
            return None
        if expires < time.time():
            return None
        principal = await self.by_id(token_id)  # revoked since: the session ends too
        if principal is None:
            return None
        return Principal(principal.name, principal.scopes, principal.runs, token_id, "session")


class _Unavailable(Exception):
    """The tokens table cannot be read (the database is down or busy)."""


def needs(method: str, path: str, settings: AuthSettings) -> str | None:
    """The scope a request needs: ingest | read | admin | ui, or None (open)."""
    if path in OPEN_PATHS or path == "/runbooks" or path.startswith(("/runbooks/", "/docs/")):
        return None
    if path == "/metrics":
        return settings.metrics_scope
    if path in INGEST_PATHS and method == "POST":
        return "ingest"
    if path.startswith(("/api/", "/v1/")):
        return "read" if method in ("GET", "HEAD") else "admin"
    return "ui"


def check_admin() -> None:
    """Refuse a change made by a principal without ``admin`` (the UI's in-process calls
    pass here; API requests were already checked by the middleware)."""
    principal = current.get()
    if principal is not None and not principal.allows("admin"):
        raise HTTPException(
            403,
            f"{principal.describe()} may view, not change: acknowledging, silencing, "
            "actions, incidents and notes need a token with the admin scope (log in with one "
            "at /login)",
        )


def acting(typed: str, *, limit: int = 128) -> str:
    """Who a change is recorded as (audit: acks, silences, actions, incidents, notes):
    the name typed, followed by whom the request really acts as when that differs, the
    token's name or the trusted proxy's user: ``alice (as token oncall)``. A typed name
    alone cannot pass for someone else. At most ``limit`` characters (the columns')."""
    principal = current.get()
    if principal is None or principal.name == typed:
        return typed[:limit]
    kind = "user" if principal.via == "proxy" else "token"
    suffix = f" (as {kind} {principal.name})"[: limit // 2]
    return typed[: limit - len(suffix)] + suffix


def check_run(run: str) -> None:
    """Refuse records for a run the ingest token's pattern does not match."""
    principal = current.get()
    if principal is not None and not principal.may_ingest(run):
        raise HTTPException(
            403,
            f"token {principal.name!r} may send runs matching {principal.runs!r}, "
            f"not run {run!r}; create a token for it (trainwarden token create --runs)",
        )


def vouched(sender: str | None) -> str | None:
    """A refused request's sender header (``RUN/RANKS``) if its token may send that run,
    else None: a token for one run cannot keep another run's ranks alive."""
    principal = current.get()
    if sender is None or principal is None or principal.may_ingest(sender.partition("/")[0]):
        return sender
    return None


def _bearer(headers: dict[bytes, bytes]) -> str | None:
    value = headers.get(b"authorization", b"").decode("latin-1").strip()
    scheme, _, credentials = value.partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" and credentials.strip() else None


def _cookie(headers: dict[bytes, bytes], name: str) -> str | None:
    for part in headers.get(b"cookie", b"").decode("latin-1").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


class AuthMiddleware:
    """Pure ASGI middleware: authenticates, checks the scope, rate-limits per token."""

    def __init__(self, app: Any, *, authenticator: Authenticator) -> None:
        self.app = app
        self.auth = authenticator
        self.settings = authenticator.settings

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        need = needs(method, path, self.settings)
        if need is None:
            await self.app(scope, receive, send)
            return
        try:
            await self._check(scope, receive, send, need)
        except _Unavailable as exc:  # tokens cannot be read: like any database outage
            why = (str(exc.__cause__).splitlines() or ["?"])[0]
            log.warning("trainwarden: cannot check a token: %s", why)
            await _refuse(
                send,
                503,
                "cannot check the token now (database unavailable); retry later",
                retry_after=5,
            )

    async def _check(self, scope: Any, receive: Any, send: Any, need: str) -> None:
        method, path = scope["method"], scope["path"]
        headers = dict(scope["headers"])
        principal: Principal | None = None
        raw = _bearer(headers)
        if raw is not None:
            principal = await self.auth.verify(raw)
            if principal is None:
                await _refuse(
                    send,
                    401,
                    "the token is not valid (unknown, revoked or "
                    "mistyped); create one with: trainwarden token create",
                    error="invalid_token",
                )
                return
            wait = self.auth.take(principal.token_id or principal.name)
            if wait > 0:
                await _refuse(
                    send,
                    429,
                    f"token {principal.name!r} is over its rate limit "
                    f"({self.settings.rate_per_s:g} requests/s); retry later",
                    retry_after=max(1, math.ceil(wait)),
                )
                return
        elif need in ("ui", "read"):
            principal = await self._browser(headers, ui=need == "ui")
        if principal is None:
            if need == "ui" and method in ("GET", "HEAD"):
                target = path + (
                    "?" + scope["query_string"].decode() if scope["query_string"] else ""
                )
                await _redirect(send, f"/login?next={quote(target, safe='')}")
                return
            await _refuse(
                send,
                401,
                f"this needs a token with the {_scope_of(need)} scope: "
                "send Authorization: Bearer <token>",
            )
            return
        wanted = _scope_of(need)
        if not principal.allows(wanted):
            await _refuse(
                send,
                403,
                f"{principal.describe()} lacks the {wanted} scope this needs",
                error="insufficient_scope",
                scope=wanted,
            )
            return
        reset = current.set(principal)
        try:
            await self.app(scope, receive, send)
        finally:
            current.reset(reset)

    async def _browser(self, headers: dict[bytes, bytes], *, ui: bool) -> Principal | None:
        """A browser's identity: the session cookie, or (UI only) the trusted header."""
        cookie = _cookie(headers, SESSION_COOKIE)
        if cookie:
            principal = await self.auth.session(cookie)
            if principal is not None:
                return principal
        header = self.settings.trusted_user_header
        if ui and header:
            user = headers.get(header.lower().encode(), b"").decode("utf-8", "replace").strip()
            if user:
                return Principal(
                    user[:128], frozenset({self.settings.trusted_user_scope}), via="proxy"
                )
        return None


def _scope_of(need: str) -> str:
    return "read" if need == "ui" else need


async def _refuse(
    send: Any,
    status: int,
    detail: str,
    *,
    error: str | None = None,
    scope: str | None = None,
    retry_after: int | None = None,
) -> None:
    headers = []
    if status in (401, 403):
        challenge = 'Bearer realm="trainwarden"'
        if error:
            challenge += f', error="{error}"'
        if scope:
            challenge += f', scope="{scope}"'
        headers.append((b"www-authenticate", challenge.encode()))
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await json_response(send, status, json.dumps({"detail": detail}).encode(), headers)


async def _redirect(send: Any, location: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 303,
            "headers": [(b"location", location.encode()), (b"content-length", b"0")],
        }
    )
    await send({"type": "http.response.body", "body": b""})


# -- /login and /logout: a small form served by the API, no JavaScript ----------------

router = APIRouter(include_in_schema=False)

_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>trainwarden: log in</title>
<style>body{{font:16px system-ui,sans-serif;max-width:34em;margin:4em auto;padding:0 1em}}
input{{width:100%;font:inherit;padding:.4em;box-sizing:border-box}}button{{font:inherit;
margin-top:.8em;padding:.4em 1.2em}}.error{{color:#b00020}}code{{background:#eee;padding:0 .2em}}
</style></head><body><h1>trainwarden</h1>{message}
<form method="post" action="/login"><input type="hidden" name="next" value="{next}">
<label for="token">Token (read to view, admin to acknowledge, silence and act)</label>
<input id="token" name="token" type="password" autocomplete="off" autofocus required
 placeholder="tw_…"><button type="submit">Log in</button></form>
<p>No token? On the collector's host: <code>trainwarden token create NAME --scope read</code>
(or <code>--scope admin</code>).</p></body></html>"""


def _safe_next(target: str | None) -> str:
    """Only a path on this site: never an open redirect."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target


def _form(message: str, target: str, status: int = 200) -> HTMLResponse:
    shown = f'<p class="error">{html.escape(message)}</p>' if message else ""
    return HTMLResponse(_PAGE.format(message=shown, next=html.escape(target)), status_code=status)


async def _log_in(request: Request, raw: str, target: str) -> Response:
    authenticator: Authenticator = request.app.state.authenticator
    try:
        principal = await authenticator.verify(raw)
    except _Unavailable:
        return _form(
            "The collector cannot check tokens now (database unavailable); try again in a moment.",
            target,
            503,
        )
    if principal is None:
        return _form("That token is not valid (unknown, revoked or mistyped).", target, 401)
    if not principal.allows("read"):
        return _form(
            f"Token {principal.name!r} may only send records "
            f"({', '.join(sorted(principal.scopes))}); "
            "the UI needs one with read or admin.",
            target,
            403,
        )
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        authenticator.session_cookie(principal),
        max_age=int(authenticator.settings.session_max_age_s),
        httponly=True,
        samesite="lax",
        secure=request.url.scheme == "https",
        path="/",
    )
    return response


@router.get("/login", response_class=HTMLResponse)
async def login_page(
    request: Request, next: str | None = None, token: str | None = None
) -> Response:
    """The login form; ``?token=`` logs in at once (the demo prints such a link)."""
    target = _safe_next(next)
    if token:
        return await _log_in(request, token, target)
    return _form("", target)


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    """Check the pasted token and open a session (a signed cookie naming the token)."""
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    target = _safe_next((form.get("next") or ["/"])[0])
    raw = (form.get("token") or [""])[0].strip()
    if not raw:
        return _form("Paste a token.", target, 400)
    return await _log_in(request, raw, target)


@router.api_route("/logout", methods=["GET", "POST"])
def logout() -> Response:
    """End the UI session."""
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response
