"""Posting a post-mortem where the team reads it: a Slack-compatible or generic webhook
(``--postmortem-post``), never raising: the outcome says what happened."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainwarden.collector.incidents.report_format import render_markdown


@dataclass(frozen=True)
class PostOutcome:
    ok: bool
    status: int | None
    error: str | None

    def describe(self) -> str:
        if self.ok:
            return f"posted (HTTP {self.status})"
        if self.status is not None:
            return f"HTTP {self.status}" + (f": {self.error}" if self.error else "")
        return str(self.error)


def post_kind(url: str, kind: str = "auto") -> str:
    if kind != "auto":
        return kind
    return "slack" if "slack" in url.lower() else "webhook"


def payload(report: dict[str, Any], kind: str) -> dict[str, Any]:
    """Slack-compatible: ``{"text": mrkdwn}``. Generic webhook: the Markdown as ``text``
    and the report (without chart data) as ``report``."""
    if kind == "slack":
        return {"text": render_markdown(report, flavor="slack")}
    slim = {
        **report,
        "incidents": [{k: v for k, v in t.items() if k != "charts"} for t in report["incidents"]],
    }
    return {"text": render_markdown(report), "report": slim}


def post_report(
    report: dict[str, Any], url: str, *, kind: str = "auto", timeout_s: float = 10.0
) -> PostOutcome:
    """POST the report to ``url``; never raises: the outcome says what happened."""
    import httpx  # httpx: only a report that is posted needs a client

    try:
        body = json.dumps(payload(report, post_kind(url, kind)), default=str)
        response = httpx.post(
            url, content=body, headers={"Content-Type": "application/json"}, timeout=timeout_s
        )
    except httpx.HTTPError as exc:
        return PostOutcome(False, None, f"{type(exc).__name__}: {exc}")
    if response.is_success:
        return PostOutcome(True, response.status_code, None)
    return PostOutcome(False, response.status_code, response.text.strip().replace("\n", " ")[:200])
