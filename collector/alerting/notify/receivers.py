"""The receivers a notification can go to, one small adapter each behind one protocol
(:class:`Notifier`): Alertmanager (API v2), PagerDuty Events v2, a Slack-compatible
webhook, and a generic webhook that gets Alertmanager's webhook JSON."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, ClassVar, Protocol

import httpx

from trainwarden.alerts.notification import Notification

KIND_NAMES = ("alertmanager", "pagerduty", "slack", "webhook")
PAGERDUTY_URL = "https://events.pagerduty.com/v2/enqueue"
RESEND_VALIDITY_S = (
    4 * 3600.0
)  # four times the engine's hourly re-send (collector/alerting/engine.py)
"""How long Alertmanager keeps a firing alert without news: 4 x a 3.75 min re-send."""
RETRYABLE_STATUS = frozenset({408, 429})  # and every 5xx: the rest of 4xx will not change


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
