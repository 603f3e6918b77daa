"""The alerts page in a real headless Chromium, served by a real ``trainwarden serve`` on
SQLite and on PostgreSQL: an XID 79 reaches the collector, its engine fires FatalXid, and
an on-call engineer finds it with its runbook, acknowledges it and silences the run."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..collector.helpers import batch, step
from ..helpers import Server, wait_for

RUN = "ui-alerts"


def ingest_xid(server: Server, *, run: str = RUN, code: int = 79) -> None:
    now = time.time()
    body = batch(
        run,
        rank=0,
        world_size=1,
        steps=[{**step(1), "ts": now - 1}],
        events=[
            {
                "id": f"xid-{now}",
                "kind": "xid",
                "ts": now,
                "severity": "critical",
                "data": {"code": code},
            }
        ],
    )
    body["agent"].update(sent_at=now, heartbeat_s=2.0, last_step=1, last_step_end=now)
    response = httpx.post(f"{server.url}/api/v1/ingest", json=body, timeout=10)
    assert response.status_code == 200, response.text


def drew_table(response: Any) -> bool:
    """A refresh's answer that draws the alerts table anew."""
    if "_dash-update-component" not in response.url:
        return False
    try:
        return "alerts-table" in response.json().get("response", {})
    except Exception:  # 204 (nothing to update) and the like
        return False


def shown(page: Any, server: Server, calls: list[str], selector: str, text: str) -> None:
    """Wait for ``selector`` with ``text``; if it never shows, say what the page sent, what
    it logged and what the collector logged (CI once missed the notice with no trace)."""
    try:
        page.locator(selector, has_text=text).wait_for(timeout=20_000)
    except Exception as exc:
        sent = [c[:300] for c in calls if "alerts-feedback" in c]
        raise AssertionError(
            f"no {selector} with {text!r}: {exc}\n"
            f"feedback now: {page.inner_html('#alerts-feedback')!r}\n"
            f"callback requests for the feedback ({len(sent)}): {sent}\n"
            f"console errors: {page.errors}\n"
            f"collector log tail:\n{server.log.read_text(errors='replace')[-3000:]}"
        ) from None


def firing(server: Server, rule: str) -> dict[str, Any] | None:
    found = server.get("/api/v1/alerts", run=RUN, rule=rule, state="firing").json()
    return found[0] if found else None


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_alerts_page_lists_acknowledges_and_silences(live_server: Server, page: Any) -> None:
    server = live_server
    ingest_xid(server)
    alert = wait_for(lambda: firing(server, "FatalXid"), 15, "FatalXid firing")

    page.goto(f"{server.url}/alerts")
    row = page.locator(f"#alert-{alert['id']}")
    row.wait_for(timeout=20_000)
    assert "FatalXid" in row.inner_text() and "XID 79" in row.inner_text()
    assert row.locator(".severity-critical").count() == 1
    assert row.locator(".status-firing").count() == 1
    runbook = row.locator("a.runbook-link")
    assert (runbook.get_attribute("href") or "").endswith("/runbooks/FatalXid")
    assert page.locator(f"#alert-{alert['id']} a.run-link").get_attribute("href") == f"/runs/{RUN}"

    # The age counts on in the browser, and the table is not redrawn for it (each redraw
    # replaced the buttons under the pointer and sent the buttons' callback once more):
    # a refresh every 2 s, and at most one redraw in 6 s (another alert may fire).
    calls: list[str] = []  # the page's callback requests: to count, and for a failure
    redraws: list[float] = []
    page.on(
        "request",
        lambda r: calls.append(r.post_data or "") if "_dash-update-component" in r.url else None,
    )
    page.on("response", lambda r: redraws.append(time.time()) if drew_table(r) else None)
    age = row.locator(".ago").first
    first_age = age.inner_text()
    page.wait_for_timeout(6_000)
    assert age.inner_text() != first_age and age.inner_text().endswith("s ago")
    assert len(redraws) <= 1, redraws

    # Acknowledge asks for a name first; once typed, it acts and the API says who.
    row.get_by_role("button", name="Acknowledge").click()
    shown(page, server, calls, "#alerts-feedback .notice-error", "Your name")
    page.fill("#alerts-by", "ana")
    row.get_by_role("button", name="Acknowledge").click()
    acked = wait_for(lambda: firing(server, "FatalXid")["acked_by"], 10, "acknowledgement")
    assert acked == "ana"
    row.locator(".mark-acked", has_text="acked by ana").wait_for(timeout=10_000)
    assert row.get_by_role("button", name="Acknowledge").count() == 0

    # "Silence…" on the alert fills the form with its run, rank and rule.
    row.get_by_role("button", name="Silence…").click()
    page.wait_for_function(
        "document.querySelector('#alerts-silence-alertname').value === 'FatalXid'", timeout=10_000
    )
    assert page.input_value("#alerts-silence-run") == RUN
    page.fill("#alerts-silence-rank", "")
    page.fill("#alerts-silence-comment", "node0 drained, replacing the GPU")
    page.click("#alerts-silence-submit")
    silences = wait_for(lambda: server.get("/api/v1/silences").json(), 10, "silence")
    assert {(m["name"], m["value"]) for m in silences[0]["matchers"]} == {
        ("run", RUN),
        ("alertname", "FatalXid"),
    }
    assert silences[0]["created_by"] == "ana"
    silence_row = page.locator(f"#silence-{silences[0]['id']}")
    silence_row.wait_for(timeout=10_000)
    # The engine marks the alert silenced at its next pass; the page shows it live.
    row.locator(".mark-silenced").wait_for(timeout=15_000)

    # The filters are in the URL, and changing them keeps what was typed.
    page.get_by_role("option", name="resolved").click()
    page.wait_for_url("**/alerts?state=pending&state=firing&state=resolved", timeout=10_000)
    assert page.input_value("#alerts-by") == "ana"
    assert page.input_value("#alerts-silence-comment") == "node0 drained, replacing the GPU"
    if os.environ.get("TRAINWARDEN_SCREENSHOTS"):
        page.wait_for_timeout(500)
        shots = Path(os.environ["TRAINWARDEN_SCREENSHOTS"])
        page.screenshot(path=str(shots / "alerts-page.png"), full_page=True)
    # Back in the browser's history: the URL and the filters go back together.
    page.go_back()
    page.wait_for_url("**/alerts", timeout=10_000)
    page.wait_for_function(
        "!document.querySelector('#alerts-states input[value=resolved]').checked", timeout=10_000
    )

    silence_row.get_by_role("button", name="End").click()
    wait_for(lambda: server.get("/api/v1/silences").json() == [], 10, "the silence ended")
    silence_row.wait_for(state="detached", timeout=10_000)

    # The FatalXid's eviction (dry-run by default) is in the actions table.
    page.locator(".action-row", has_text="evict").wait_for(timeout=10_000)

    page.goto(f"{server.url}/alerts?run=no-such-run&state=firing")
    page.locator("#alerts-table .notice", has_text="No alerts firing for run no-such-run").wait_for(
        timeout=20_000
    )

    # The run page lists its open alerts above the graphs, with the runbook.
    page.goto(f"{server.url}/runs/{RUN}")
    item = page.locator("#run-alerts .alert-item", has_text="FatalXid")
    item.wait_for(timeout=20_000)
    assert (item.locator("a.runbook-link").get_attribute("href") or "").endswith(
        "/runbooks/FatalXid"
    )
    assert "Traceback" not in page.content()
    assert page.errors == []
