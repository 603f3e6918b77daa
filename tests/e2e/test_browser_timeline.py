"""The timeline page in a real headless Chromium, served by a real ``trainwarden serve``
(with a price per GPU-hour), on the rollback drill's rows of
:mod:`tests.collector.incident_scenario` written into its database: serve's own incident
engine groups them into an incident, whose figures the page must show as the report
computes them. A second run has no incident at all."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from trainwarden.collector.store.db import make_engine

from ..collector import incident_scenario as sc
from ..helpers import Server, start_serve, stop_serve, wait_for
from .helpers import screenshot

CALM = "calm"  # a run where nothing went wrong


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ui-timeline")
    db_url = f"sqlite:///{tmp / 'ui.db'}"
    server = start_serve(db_url, tmp / "serve.log", env={"TRAINWARDEN_PRICE_PER_GPU_HOUR": "2"})
    engine = make_engine(db_url)
    try:
        sc.rollback_incident(engine)
        sc.make_run(engine, CALM, steps=10)
    finally:
        engine.dispose()
    wait_for(lambda: server.get(f"/api/v1/runs/{sc.RUN}/incidents").json(), 30, "the incident")
    yield server
    stop_serve(server)


def incident_id(server: Server) -> int:
    (incident,) = server.get(f"/api/v1/runs/{sc.RUN}/incidents").json()
    return int(incident["id"])


def entry_texts(page: Any) -> list[str]:
    return [t.strip() for t in page.locator("#tl-entries tr.tl-entry .tl-text").all_inner_texts()]


def position(texts: list[str], part: str) -> int:
    found = [i for i, t in enumerate(texts) if part in t]
    assert found, f"no entry with {part!r} in {texts}"
    return found[0]


def test_an_incident_shows_its_entries_in_order_its_figures_and_downloads(
    server: Server, page: Any
) -> None:
    n = incident_id(server)
    page.goto(f"{server.url}/runs/{sc.RUN}/timeline?incident={n}")
    page.locator(f"#tl-inc-{n}.tl-inc-selected").wait_for(timeout=20_000)  # the URL selected it
    page.locator("#tl-entries tr.tl-entry").first.wait_for(timeout=20_000)
    texts = entry_texts(page)
    order = [
        position(texts, part)
        for part in (
            "fault injected (drill): loss_spike=50x@step=35",
            "LossSpike pending",
            "LossSpike firing",
            "delivered to hook",
            "rollback executing",
            "rollback done",
            "recovered: step 40",
        )
    ]
    assert order == sorted(order), texts
    # The alert's rows link to its runbook; the firing alert is critical.
    firing = page.locator("#tl-entries tr.tl-alert", has_text="LossSpike firing")
    assert "tl-sev-critical" in (firing.get_attribute("class") or "")
    assert firing.locator("a.runbook-link").get_attribute("href") == "/runbooks/LossSpike"

    # The figures, as the collector derives them (incident_scenario.EXPECTED), and the
    # cost at the serve's price (2 per GPU-hour).
    def fig(key: str) -> str:
        return page.locator(f"#tl-fig-{key} .tl-fig-value").inner_text()

    assert fig("detect_s") == "0.8 s"
    assert fig("page_s") == "0.5 s"
    assert fig("act_s") == "1.0 s"
    assert fig("recover_s") == "4.8 s"
    assert fig("steps_lost") == "10"
    assert fig("time_lost_s") == "5.3 s"
    assert fig("gpu_hours_lost") == "0.003 (2 GPUs)"
    assert fig("cost") == "0.01 at 2 per GPU-hour"
    page.wait_for_selector("#tl-chart .scatterlayer .trace", timeout=10_000)
    screenshot(page, "timeline.png")

    types = {"md": "text/markdown", "html": "text/html", "json": "application/json"}
    for fmt, media in types.items():
        href = page.locator(f"#tl-download-{fmt}").get_attribute("href")
        assert href is not None and f"incident={n}" in href
        got = httpx.get(server.url + href, timeout=30)
        assert got.status_code == 200, got.text
        assert got.headers["content-type"].startswith(media)
        assert (
            f'filename="postmortem-{sc.RUN}-incident-{n}.{fmt}"'
            in got.headers["content-disposition"]
        )
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_a_note_from_the_form_joins_the_timeline_and_the_logbook(server: Server, page: Any) -> None:
    n = incident_id(server)
    page.goto(f"{server.url}/runs/{sc.RUN}/timeline?incident={n}")
    page.locator("#tl-entries tr.tl-entry").first.wait_for(timeout=20_000)
    page.click("#tl-note-add")  # no name yet: the page says what is missing
    page.locator("#tl-feedback .notice-error", has_text="Your name").wait_for(timeout=10_000)
    page.fill("#tl-author", "ana")
    page.fill("#tl-note-text", "checked the loss curve: the rollback took")
    page.click("#tl-note-add")
    page.locator("#tl-feedback", has_text="added to run").wait_for(timeout=10_000)
    page.locator("#tl-entries tr.tl-note", has_text="ana: checked the loss curve").wait_for(
        timeout=10_000
    )
    assert page.input_value("#tl-note-text") == ""  # ready for the next one
    notes = server.get(f"/api/v1/runs/{sc.RUN}/notes").json()
    assert [(x["author"], x["text"], x["incident"]) for x in notes] == [
        ("ana", "checked the loss curve: the rollback took", n)
    ]
    assert page.errors == []


def test_whole_run_no_incidents_unknown_incident_and_missing_run_say_so(
    server: Server, page: Any
) -> None:
    page.goto(f"{server.url}/runs/{CALM}/timeline")
    page.locator("#tl-incidents .notice", has_text="No incidents").wait_for(timeout=20_000)
    assert page.locator("#tl-inc-all.tl-inc-selected").count() == 1
    assert page.locator("#tl-figures .tl-fig").count() == 0

    n = incident_id(server)
    page.goto(f"{server.url}/runs/{sc.RUN}/timeline?incident=999")
    page.locator("#tl-notice .notice-error", has_text="has no incident 999").wait_for(
        timeout=20_000
    )
    page.locator("#tl-entries tr.tl-entry").first.wait_for(timeout=10_000)  # the whole run
    page.locator(f"#tl-inc-{n}").click()  # picking it from the list: the URL follows
    page.wait_for_url(f"**/timeline?incident={n}", timeout=10_000)
    page.locator("#tl-fig-detect_s", has_text="0.8 s").wait_for(timeout=10_000)

    page.goto(f"{server.url}/runs/no-such-run/timeline")
    page.locator("#tl-notice .notice-error", has_text="not found").wait_for(timeout=20_000)
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_dark_theme_redraws_the_chart(server: Server, page: Any) -> None:
    page.goto(f"{server.url}/runs/{sc.RUN}/timeline?incident={incident_id(server)}")
    page.wait_for_selector("#tl-chart .scatterlayer .trace", timeout=20_000)
    page.click("#theme-toggle")
    page.wait_for_function(
        "document.querySelector('#tl-chart .js-plotly-plot')"
        ".layout.template.layout.paper_bgcolor === 'rgb(17,17,17)'",
        timeout=10_000,
    )
    assert page.errors == []
