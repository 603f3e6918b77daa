"""Notifiers: who gets paged when an alert fires or resolves, and the deliveries to them.

The engine hands each :class:`Notification` (an alert that starts firing, is re-sent,
or resolves) to a :class:`Dispatcher`, which routes it by its labels (:class:`Route`)
to the receivers of a YAML file (:func:`load_notify_config`, see docs/notifiers.md):
Alertmanager (API v2), PagerDuty Events v2, a Slack-compatible webhook, or a generic
webhook that gets Alertmanager's webhook JSON. Each receiver is a small adapter behind
one protocol, :class:`Notifier`.

``Dispatcher.submit()`` only appends to the receiver's bounded queue, from any thread:
a receiver that is down or slow never blocks the caller. Each receiver has its own
worker task; deliveries of different alerts run side by side (a hung request delays
nobody else), those of one alert in order (a resolve never overtakes its firing).
A failed attempt is retried with jittered exponential backoff while it can succeed
(timeouts, connection errors, 408, 429, 5xx), and every attempt is reported to
``on_attempt`` as an :class:`Attempt`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Protocol, Union
from urllib.parse import urlsplit

import httpx
from pydantic import ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from .config_file import ConfigFileError, Loc, StrictModel, describe, field_path, read_yaml

log = logging.getLogger(__name__)

KIND_NAMES = ("alertmanager", "pagerduty", "slack", "webhook")
PAGERDUTY_URL = "https://events.pagerduty.com/v2/enqueue"
RESEND_VALIDITY_S = (
    4 * 3600.0
)  # four times the engine's hourly re-send (collector/alerting/engine.py)
"""How long Alertmanager keeps a firing alert without news: 4 x a 3.75 min re-send."""
RETRYABLE_STATUS = frozenset({408, 429})  # and every 5xx: the rest of 4xx will not change


@dataclass(frozen=True)
class Notification:
    """What the engine says about one alert: it fires (or is re-sent), or it resolved."""

    alert_id: int
    fingerprint: str
    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None
    generator_url: str | None = None

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")


@dataclass(frozen=True)
class Attempt:
    """One delivery attempt of one notification to one receiver."""

    alert_id: int
    fingerprint: str
    status: str
    receiver: str
    kind: str
    attempt: int
    ok: bool
    http_status: int | None
    error: str | None
    at: float
    duration_s: float
    final: bool
    """No more attempts follow: delivered, or given up."""


class DeliveryError(Exception):
    """A delivery that failed; ``retryable`` when trying again may help."""

    def __init__(self, message: str, http_status: int | None = None, retryable: bool = True):
        super().__init__(message)
        self.message = message
        self.http_status = http_status
        self.retryable = retryable


class Notifier(Protocol):
    """A receiver: sends one notification, returns the HTTP status or raises DeliveryError."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> str: ...
    async def send(self, n: Notification, client: httpx.AsyncClient) -> int: ...


# -- payloads -------------------------------------------------------------------------


def rfc3339(t: float) -> str:
    """Epoch seconds as RFC 3339 UTC with milliseconds: ``2024-05-01T12:00:00.000Z``."""
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")[:-6] + "Z"


def _error_text(resp: httpx.Response) -> str:
    body = " ".join(resp.text.split())[:200]
    return f"HTTP {resp.status_code}: {body}" if body else f"HTTP {resp.status_code}"


def _connect_error(exc: BaseException) -> str:
    """``connect refused``, else the innermost reason (httpx says "All connection
    attempts failed" for both a refusal and an unreachable host)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return "connect refused"
        exc, cause = cause, cause.__cause__ or cause.__context__
    return f"connect failed: {exc}"[:200]


async def post_json(client: httpx.AsyncClient, url: str, body: Any, headers: dict[str, str]) -> int:
    """POST ``body`` as JSON; the status on 2xx, else :class:`DeliveryError`."""
    try:
        resp = await client.post(url, json=body, headers=headers)
    except httpx.TimeoutException as exc:
        what = "connect timed out" if isinstance(exc, httpx.ConnectTimeout) else "timed out"
        raise DeliveryError(f"{what} after {client.timeout.read:g}s") from None
    except httpx.ConnectError as exc:
        raise DeliveryError(_connect_error(exc)) from None
    except httpx.HTTPError as exc:
        raise DeliveryError(f"{type(exc).__name__}: {exc}"[:200]) from None
    if resp.is_success:
        return resp.status_code
    code = resp.status_code
    raise DeliveryError(_error_text(resp), code, code in RETRYABLE_STATUS or code >= 500)


@dataclass(frozen=True)
class _HttpNotifier:
    name: str
    url: str
    headers: dict[str, str] = field(default_factory=dict, repr=False)  # may hold a token
    kind: ClassVar[str]

    def endpoint(self) -> str:
        return self.url

    def body(self, n: Notification, now: float) -> Any:
        raise NotImplementedError

    async def send(self, n: Notification, client: httpx.AsyncClient) -> int:
        return await post_json(client, self.endpoint(), self.body(n, time.time()), self.headers)


@dataclass(frozen=True)
class AlertmanagerNotifier(_HttpNotifier):
    """``POST {url}/api/v2/alerts``. A firing alert is valid ``resend_validity_s`` from
    each send (Alertmanager resolves it by itself if the re-sends stop); a resolved one
    ends at its resolve time."""

    resend_validity_s: float = RESEND_VALIDITY_S
    kind: ClassVar[str] = "alertmanager"

    def endpoint(self) -> str:
        return self.url.rstrip("/") + "/api/v2/alerts"

    def body(self, n: Notification, now: float) -> Any:
        ends = now + self.resend_validity_s if n.status == "firing" else (n.ends_at or now)
        alert: dict[str, Any] = {
            # an empty label value is no label to Alertmanager (it refuses some)
            "labels": {k: str(v) for k, v in n.labels.items() if str(v) != ""},
            "annotations": {k: str(v) for k, v in n.annotations.items()},
            "startsAt": rfc3339(n.starts_at),
            "endsAt": rfc3339(ends),
        }
        if n.generator_url:
            alert["generatorURL"] = n.generator_url
        return [alert]


PD_SEVERITY = {"critical": "critical", "warning": "warning", "info": "info"}


@dataclass(frozen=True)
class PagerDutyNotifier(_HttpNotifier):
    """Events API v2: trigger, then resolve, one incident per alert (``dedup_key``)."""

    routing_key: str = field(default="", repr=False)  # a secret: kept out of logs
    url: str = PAGERDUTY_URL
    kind: ClassVar[str] = "pagerduty"

    def body(self, n: Notification, now: float) -> Any:
        event: dict[str, Any] = {
            "routing_key": self.routing_key,
            "event_action": "trigger" if n.status == "firing" else "resolve",
            "dedup_key": n.fingerprint,
        }
        if n.status == "resolved":
            return event  # PagerDuty needs nothing else to resolve
        labels = n.labels
        payload: dict[str, Any] = {
            "summary": f"[{n.severity or 'alert'}] {n.alertname}: {_summary(n)}"[:1024],
            "source": labels.get("node") or labels.get("run") or "trainwarden",
            "severity": PD_SEVERITY.get(n.severity, "error"),
            "timestamp": rfc3339(n.starts_at),
            "class": n.alertname,
            "custom_details": {**labels, **n.annotations},
        }
        if "rank" in labels:
            payload["component"] = f"rank {labels['rank']}"
        if "run" in labels:
            payload["group"] = labels["run"]
        event["payload"] = payload
        event["client"] = "trainwarden"
        if n.generator_url:
            event["client_url"] = n.generator_url
        if n.annotations.get("runbook_url"):
            event["links"] = [{"href": n.annotations["runbook_url"], "text": "Runbook"}]
        return event


def _summary(n: Notification) -> str:
    return n.annotations.get("summary") or n.annotations.get("description") or n.alertname


def _mrkdwn(block: str, text: str) -> dict[str, Any]:
    return {"type": block, "text": {"type": "mrkdwn", "text": text}}


def _slack_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@dataclass(frozen=True)
class SlackNotifier(_HttpNotifier):
    """An incoming webhook (Slack, Mattermost, Rocket.Chat): ``text`` plus ``blocks``."""

    kind: ClassVar[str] = "slack"

    def body(self, n: Notification, now: float) -> Any:
        firing = n.status == "firing"
        icon = ":rotating_light:" if firing else ":white_check_mark:"
        head = f"[{n.status.upper()}] {n.alertname} ({n.severity or 'no severity'})"
        where = " · ".join(
            f"{key} `{_slack_escape(n.labels[key])}`"
            for key in ("run", "rank", "node", "gpu")
            if n.labels.get(key)
        )
        links = []
        if n.annotations.get("runbook_url"):
            links.append(f"<{n.annotations['runbook_url']}|Runbook>")
        if n.generator_url:
            links.append(f"<{n.generator_url}|Open in trainwarden>")
        summary = _slack_escape(_summary(n))
        title = f"{icon} *{_slack_escape(head)}*"
        text = f"{title} {summary}" + (f" ({' · '.join(links)})" if links else "")
        blocks: list[dict[str, Any]] = [_mrkdwn("section", f"{title}\n{summary}")]
        if where:
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": where}]})
        if links:
            blocks.append(_mrkdwn("section", " · ".join(links)))
        return {"text": text, "blocks": blocks}


@dataclass(frozen=True)
class WebhookNotifier(_HttpNotifier):
    """Alertmanager's webhook JSON (version 4), one alert per POST; ``groupKey`` is the
    alert's fingerprint."""

    external_url: str = ""
    kind: ClassVar[str] = "webhook"

    def body(self, n: Notification, now: float) -> Any:
        ends = "0001-01-01T00:00:00Z" if n.status == "firing" else rfc3339(n.ends_at or now)
        return {
            "version": "4",
            "groupKey": n.fingerprint,
            "truncatedAlerts": 0,
            "status": n.status,
            "receiver": self.name,
            "groupLabels": dict(n.labels),
            "commonLabels": dict(n.labels),
            "commonAnnotations": dict(n.annotations),
            "externalURL": self.external_url,
            "alerts": [
                {
                    "status": n.status,
                    "labels": n.labels,
                    "annotations": n.annotations,
                    "startsAt": rfc3339(n.starts_at),
                    "endsAt": ends,
                    "generatorURL": n.generator_url or "",
                    "fingerprint": n.fingerprint,
                }
            ],
        }


# -- configuration ----------------------------------------------------------------------


class NotifyConfigError(ConfigFileError):
    """A notifier config that cannot be used; one line per problem, each naming the file,
    the receiver or route, and the field."""


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_LABEL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Strict(StrictModel):
    model_config = ConfigDict(frozen=True)


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http:// or https:// URL with a host")
    return value


class _Receiver(_Strict):
    name: str
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    send_resolved: bool | None = None
    """Default: the file's ``send_resolved``."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(f"{value!r}: use letters, digits, '_', '.' and '-' (64 at most)")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _http_url(value)


class _AlertmanagerSpec(_Receiver):
    kind: Literal["alertmanager"]
    resend_validity_s: float = Field(default=RESEND_VALIDITY_S, gt=0)


class _PagerDutySpec(_Receiver):
    kind: Literal["pagerduty"]
    routing_key: str = Field(min_length=1)
    url: str = PAGERDUTY_URL


class _SlackSpec(_Receiver):
    kind: Literal["slack"]


class _WebhookSpec(_Receiver):
    kind: Literal["webhook"]
    external_url: str = ""


_Spec = Annotated[
    Union[_AlertmanagerSpec, _PagerDutySpec, _SlackSpec, _WebhookSpec],  # noqa: UP007  # pydantic needs the Union of a discriminated union on 3.10
    Field(discriminator="kind"),
]


class _RouteSpec(_Strict):
    model_config = ConfigDict(coerce_numbers_to_str=True)

    match: dict[str, str] = Field(default_factory=dict)
    match_re: dict[str, str] = Field(default_factory=dict)
    receivers: list[str] = Field(min_length=1)
    continue_: bool = Field(default=True, alias="continue")

    @field_validator("match", "match_re")
    @classmethod
    def _label_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _LABEL.fullmatch(key):
                raise ValueError(f"{key!r} is not a label name (letters, digits, _)")
        return value

    @field_validator("match_re")
    @classmethod
    def _regexes(cls, value: dict[str, str]) -> dict[str, str]:
        for key, pattern in value.items():
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{key}: {pattern!r} is not a regular expression: {exc}") from None
        return value


class _File(_Strict):
    receivers: list[_Spec] = Field(min_length=1)
    routes: list[_RouteSpec] = Field(min_length=1)
    send_resolved: bool = True


@dataclass(frozen=True)
class Route:
    """Receivers for the notifications whose labels match: ``match`` exactly, ``match_re``
    as full-match regexes (a missing label is the empty string, as in Alertmanager)."""

    receivers: tuple[str, ...]
    match: dict[str, str] = field(default_factory=dict)
    match_re: dict[str, re.Pattern[str]] = field(default_factory=dict)
    continue_: bool = True
    """Also try the routes after this one when it matches."""

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k, "") == v for k, v in self.match.items()) and all(
            p.fullmatch(labels.get(k, "")) for k, p in self.match_re.items()
        )


@dataclass(frozen=True)
class NotifyConfig:
    receivers: dict[str, Notifier]
    routes: list[Route]
    no_resolved: frozenset[str] = frozenset()
    """Receivers with ``send_resolved: false``: told when alerts fire, not when they end."""

    def receivers_for(self, n: Notification) -> list[Notifier]:
        """Every matching route's receivers, each once, up to a match with ``continue: false``."""
        names: dict[str, None] = {}
        for route in self.routes:
            if route.matches(n.labels):
                names.update(dict.fromkeys(route.receivers))
                if not route.continue_:
                    break
        if n.status == "resolved":
            return [self.receivers[x] for x in names if x not in self.no_resolved]
        return [self.receivers[x] for x in names]


def _walk(node: Any, at: Loc = ()) -> Iterator[tuple[Loc, Any, str | int, str]]:
    """(where, container, key, string) for every string value in a YAML tree."""
    if isinstance(node, dict):
        items: Iterable[tuple[Any, Any]] = node.items()
    else:
        items = enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, str):
            yield (*at, key), node, key, value
        else:
            yield from _walk(value, (*at, key))


def _expand_env(doc: Any) -> list[tuple[Loc, str]]:
    """Replace ``${VAR}`` in string values, in place; the (path, problem) of each unset one."""
    problems = []
    for path, parent, key, value in list(_walk(doc)):
        missing = [m for m in _ENV.findall(value) if m not in os.environ]
        for var in missing:
            problems.append((path, f"${{{var}}}: the environment variable {var} is not set"))
        if not missing:
            parent[key] = _ENV.sub(lambda m: os.environ[m.group(1)], value)
    return problems


def _where(path: Path, doc: Any, loc: Loc) -> str:
    """``notify.yaml:12: receiver 'pd'`` or ``notify.yaml:20: route #2`` for a location."""
    if len(loc) >= 2 and loc[0] in ("receivers", "routes") and isinstance(loc[1], int):
        items = doc.get(loc[0]) if isinstance(doc, dict) else None
        raw = items[loc[1]] if isinstance(items, list) and loc[1] < len(items) else None
        line = getattr(raw, "line", 0)
        at = f"{path}:{line}" if line else str(path)
        if loc[0] == "routes":
            return f"{at}: route #{loc[1] + 1}"
        name = raw.get("name") if isinstance(raw, dict) else None
        return (
            f"{at}: receiver {name!r}" if isinstance(name, str) else f"{at}: receiver #{loc[1] + 1}"
        )
    return str(path)


def _problem(path: Path, doc: Any, loc: Loc, message: str) -> str:
    inner = loc[2:] if len(loc) >= 2 and isinstance(loc[1], int) else loc
    fields = field_path(inner)
    return f"{_where(path, doc, loc)}: {fields + ': ' if fields else ''}{message}"


def _pydantic_problem(err: ErrorDetails) -> tuple[Loc, str]:
    loc = list(err["loc"])
    if len(loc) >= 3 and loc[0] == "receivers" and loc[2] in KIND_NAMES:
        del loc[2]  # the member of the tagged union: the user wrote no such key
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind.startswith("union_tag"):
        loc.append("kind")
        given = ctx.get("tag")
        said = "is required" if given is None else f"{given!r} is not a kind"
        return tuple(loc), f"{said}; known: {', '.join(KIND_NAMES)}"
    return tuple(loc), describe(err)


def load_notify_config(path: Path | str, *, text: str | None = None) -> NotifyConfig:
    """The receivers and routes of a YAML file (or of ``text``, with ``path`` naming it in
    errors). ``${VAR}`` in a value comes from the environment. Raises
    :class:`NotifyConfigError` listing every problem."""
    path = Path(path)
    doc = read_yaml(path, what="notifier config", error=NotifyConfigError, text=text)
    if not isinstance(doc, dict):
        raise NotifyConfigError(f"{path}: expected a mapping with 'receivers' and 'routes'")
    problems = [_problem(path, doc, loc, msg) for loc, msg in _expand_env(doc)]
    try:
        spec = _File.model_validate(doc)
    except ValidationError as exc:
        found = [_pydantic_problem(err) for err in exc.errors()]
        raise NotifyConfigError(
            "\n".join(problems + [_problem(path, doc, *f) for f in found])
        ) from None
    first: dict[str, int] = {}
    for i, r in enumerate(spec.receivers):
        if r.name in first:
            problems.append(
                _problem(
                    path,
                    doc,
                    ("receivers", i, "name"),
                    f"already used by receiver #{first[r.name] + 1}",
                )
            )
        first.setdefault(r.name, i)
    for i, route in enumerate(spec.routes):
        for j, name in enumerate(route.receivers):
            if name not in first:
                problems.append(
                    _problem(
                        path,
                        doc,
                        ("routes", i, "receivers", j),
                        f"{name!r} is not a receiver; known: {', '.join(first)}",
                    )
                )
    if problems:
        raise NotifyConfigError("\n".join(problems))
    routes = [
        Route(
            tuple(r.receivers),
            dict(r.match),
            {k: re.compile(v) for k, v in r.match_re.items()},
            r.continue_,
        )
        for r in spec.routes
    ]
    quiet = [r.name for r in spec.receivers if not _default(r.send_resolved, spec.send_resolved)]
    return NotifyConfig({r.name: _notifier(r) for r in spec.receivers}, routes, frozenset(quiet))


def _default(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def _notifier(r: _Receiver) -> Notifier:
    name, url, headers = r.name, r.url, dict(r.headers)
    if isinstance(r, _AlertmanagerSpec):
        return AlertmanagerNotifier(name, url, headers, resend_validity_s=r.resend_validity_s)
    if isinstance(r, _PagerDutySpec):
        return PagerDutyNotifier(name, url, headers, routing_key=r.routing_key)
    if isinstance(r, _WebhookSpec):
        return WebhookNotifier(name, url, headers, external_url=r.external_url)
    return SlackNotifier(name, url, headers)


# -- delivery -----------------------------------------------------------------------------

MAX_IN_FLIGHT = 32
"""Requests to one receiver at once (each to a different alert)."""


class _Lane:
    """One receiver's queue. ``inbox`` takes notifications from any thread; on the event
    loop each alert (fingerprint) gets a chain, delivered in order by its own task, so a
    hung request holds up only the later notifications of the same alert."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier
        self.inbox: deque[Notification] = deque()  # append / popleft are thread-safe
        self.pending = 0  # accepted, not yet delivered or given up (under Dispatcher._lock)
        self.chains: dict[str, deque[Notification]] = {}  # fingerprint -> in flight, then next
        self.tasks: set[asyncio.Task[None]] = set()
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT)


class Dispatcher:
    """Delivers notifications to the receivers their routes name, in the background.

    ``submit()`` may be called from any thread, before or after ``start()``; deliveries
    run on the event loop ``start()`` is awaited in. ``on_attempt`` is called on that
    loop for every attempt: keep it cheap (append to a queue), it cannot break delivery.
    """

    def __init__(
        self,
        config: NotifyConfig,
        *,
        on_attempt: Callable[[Attempt], None] | None = None,
        max_attempts: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 60.0,
        timeout_s: float = 5.0,
        queue_size: int = 10_000,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1 (got {max_attempts})")
        if backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError(
                f"need 0 <= backoff_s <= max_backoff_s (got {backoff_s}, {max_backoff_s})"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive (got {timeout_s})")
        if queue_size < 1:
            raise ValueError(f"queue_size must be at least 1 (got {queue_size})")
        self.config = config
        self.on_attempt = on_attempt
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.timeout_s = timeout_s
        self.queue_size = queue_size
        self.sent = 0  # notifications delivered (per receiver)
        self.failed = 0  # ... given up
        self.dropped = 0  # ... refused by a full queue, or left when stop() ran out of time
        self._lanes = {r.name: _Lane(r) for r in config.receivers.values()}
        self._lock = threading.Lock()  # pending counts and dropped; never held across I/O
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._client: httpx.AsyncClient | None = None
        self._stopped = False
        self._closing = asyncio.Event()  # stop(): no more retries, backoffs end now

    @property
    def stats(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "failed": self.failed,
            "dropped": self.dropped,
            "pending": {name: lane.pending for name, lane in self._lanes.items()},
        }

    async def start(self) -> None:
        """Start delivering, on the running event loop (what was submitted before too)."""
        if self._loop is not None:
            raise RuntimeError("this Dispatcher was already started")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._client = httpx.AsyncClient(
            timeout=self.timeout_s, headers={"User-Agent": "trainwarden-notify"}
        )
        self._pump(list(self._lanes.values()))

    def submit(self, n: Notification) -> bool:
        """Queue ``n`` for each receiver its routes name; never blocks, never raises.
        False when a receiver's queue was full (``n`` is dropped there and counted)."""
        try:
            lanes = [self._lanes[r.name] for r in self.config.receivers_for(n)]
            accepted = True
            with self._lock:
                for lane in lanes:
                    if self._stopped or lane.pending >= self.queue_size:
                        self.dropped += 1
                        accepted = False
                        continue
                    lane.pending += 1
                    lane.inbox.append(n)
                dropped = self.dropped
            if not accepted and (dropped == 1 or dropped % 1000 == 0):
                log.warning("notification queue full or stopped: %d notifications dropped", dropped)
            self._kick(lanes)
            return accepted
        except Exception:  # the engine must go on whatever happens here
            log.exception("could not queue the notification of alert %s", n.alert_id)
            return False

    def _kick(self, lanes: list[_Lane]) -> None:
        if self._loop is None or not lanes:
            return  # start() takes them
        if threading.get_ident() == self._loop_thread:
            self._pump(lanes)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._pump, lanes)

    def _pump(self, lanes: list[_Lane]) -> None:
        """On the loop: move each inbox into the chains; a new chain gets a task."""
        for lane in lanes:
            while lane.inbox:
                n = lane.inbox.popleft()
                chain = lane.chains.get(n.fingerprint)
                if chain is not None:
                    chain.append(n)  # after the one in flight: a resolve follows its firing
                    continue
                lane.chains[n.fingerprint] = deque([n])
                task = asyncio.create_task(self._run_chain(lane, n.fingerprint))
                lane.tasks.add(task)
                task.add_done_callback(lane.tasks.discard)

    async def _run_chain(self, lane: _Lane, fp: str) -> None:
        chain = lane.chains[fp]
        try:
            while chain:
                async with lane.slots:
                    await self._deliver(lane, chain[0], chain)
                chain.popleft()
                with self._lock:
                    lane.pending -= 1
        finally:
            del lane.chains[fp]

    async def _deliver(self, lane: _Lane, n: Notification, chain: deque[Notification]) -> None:
        notifier = lane.notifier
        assert self._client is not None
        for attempt in range(1, self.max_attempts + 1):
            at, started = time.time(), time.monotonic()
            http_status: int | None = None
            error: str | None = None
            retryable = False
            try:
                http_status = await asyncio.wait_for(notifier.send(n, self._client), self.timeout_s)
            except asyncio.TimeoutError:
                error, retryable = f"timed out after {self.timeout_s:g}s", True
            except DeliveryError as exc:
                error, http_status, retryable = exc.message, exc.http_status, exc.retryable
            except Exception as exc:  # a notifier's bug: say so, and try again
                log.warning("receiver %s raised", notifier.name, exc_info=True)
                error, retryable = f"{type(exc).__name__}: {exc}"[:200], True
            final = error is None or not retryable or attempt == self.max_attempts
            if not final and len(chain) > 1:
                final, error = (
                    True,
                    f"{error}; not retried: a newer notification of this alert follows",
                )
            elif not final and self._closing.is_set():
                final, error = True, f"{error}; not retried: shutting down"
            self._report(
                Attempt(
                    n.alert_id,
                    n.fingerprint,
                    n.status,
                    notifier.name,
                    notifier.kind,
                    attempt,
                    error is None,
                    http_status,
                    error,
                    at,
                    time.monotonic() - started,
                    final,
                )
            )
            if error is None:
                self.sent += 1
                return
            if final:
                self.failed += 1
                log.warning(
                    "gave up notifying %s of %s %s (alert %s) after %d attempts: %s",
                    notifier.name,
                    n.status,
                    n.alertname,
                    n.alert_id,
                    attempt,
                    error,
                )
                return
            await self._pause(attempt)

    async def _pause(self, attempt: int) -> None:
        """Exponential backoff with jitter (a fleet of alerts does not retry in step);
        stop() ends it early."""
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._closing.wait(), delay * random.uniform(0.5, 1.0))

    def _report(self, attempt: Attempt) -> None:
        if self.on_attempt is None:
            return
        try:
            self.on_attempt(attempt)
        except Exception:
            log.exception(
                "on_attempt failed for an attempt to %s; delivery goes on", attempt.receiver
            )

    def _pending(self) -> int:
        with self._lock:
            return sum(lane.pending for lane in self._lanes.values())

    async def drain(self, timeout_s: float) -> None:
        """Wait until everything submitted is delivered or given up, or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self._pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def stop(self, deadline_s: float = 5.0) -> None:
        """Refuse new notifications, give what is queued one last try (no more backoff)
        until ``deadline_s``, then drop what is left (counted) and close."""
        with self._lock:
            self._stopped = True
        self._closing.set()
        if self._loop is not None:  # else nothing was ever sent: drop it all
            await self.drain(deadline_s)
        tasks = [task for lane in self._lanes.values() for task in lane.tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with self._lock:
            left = sum(lane.pending for lane in self._lanes.values())
            for lane in self._lanes.values():
                lane.pending = 0
                lane.inbox.clear()
            self.dropped += left
        if left:
            log.warning("stopped with %d notifications undelivered (dropped)", left)
        if self._client is not None:
            await self._client.aclose()
