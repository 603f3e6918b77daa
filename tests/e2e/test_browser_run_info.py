"""The run page in a real headless Chromium, served by a real ``trainwarden serve`` (a
price per GPU-hour and a job MTBF of 7 h), on runs sent over HTTP as the agents send them
(:mod:`tests.collector.economics_scenario`): a run with two attempts and checkpoints, a
second run to compare with, and one from an agent older than run identity."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ..collector import economics_scenario as sc
from ..helpers import Server, start_serve, stop_serve, wait_for
from .helpers import screenshot

BARS = """(sel) => {
    const g = document.querySelector(sel + " .js-plotly-plot");
    return g && g.data && g.data.length && g.querySelectorAll(".trace.bars").length
        ? g.data.map(t => [t.name, t.x[0]]) : null;
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ui-run-info")
    server = start_serve(
        f"sqlite:///{tmp / 'ui.db'}",
        tmp / "serve.log",
        env={
            "TRAINWARDEN_PRICE_PER_GPU_HOUR": str(sc.PRICE),
            "TRAINWARDEN_MTBF_HOURS": str(sc.MTBF_HOURS),
        },
    )

    def post(body: dict[str, Any]) -> None:
        r = httpx.post(f"{server.url}/api/v1/ingest", json=body, timeout=30)
        assert r.status_code == 200, r.text

    try:
        sc.seed(post)
        # serve's rollup worker: the steps' time is what goodput keeps
        wait_for(
            lambda: (
                server.get(f"/api/v1/runs/{sc.RUN}/economics").json()["goodput"]["kept_steps"] > 0
            ),
            30,
            "the step rollups",
        )
    except BaseException:
        stop_serve(server)
        raise
    yield server
    stop_serve(server)


def test_the_run_page_shows_identity_attempts_goodput_and_the_advice(
    server: Server, page: Any
) -> None:
    page.goto(f"{server.url}/runs/{sc.RUN}/info")
    page.locator("#ri-config").wait_for(timeout=20_000)
    config = page.locator("#ri-config").inner_text()
    assert "optim.name\tadamw" in config and "lr\t0.0003" in config
    assert page.locator("#ri-code").inner_text() == "9f8e7d6 (dirty) on main"
    assert "NVIDIA H100 80GB HBM3" in page.locator("#ri-env").inner_text()
    # Both attempts, the first with why it ended; the second still running.
    first = page.locator("#ri-attempt-1").inner_text()
    assert "exception" in first and "CUDA error: an illegal memory access" in first
    assert "running" in page.locator("#ri-attempt-2").inner_text()
    # ETTR as the API computes it (a little more wall time passes between the two reads).
    econ = server.get(f"/api/v1/runs/{sc.RUN}/economics").json()
    shown = float(page.locator("#ri-ettr").inner_text().rstrip("%"))
    assert shown == pytest.approx(100 * econ["goodput"]["ettr"], abs=0.3)
    # The breakdown, drawn: one stacked bar of six parts that add up to the allocation.
    drawn = page.wait_for_function(BARS, arg="#ri-breakdown", timeout=20_000).json_value()
    assert [name for name, _ in drawn] == [
        "kept",
        "replayed",
        "recovery",
        "checkpoint",
        "data wait",
        "other",
    ]
    assert sum(x for _, x in drawn) == pytest.approx(100, abs=0.01)
    # T* = sqrt(2 x 20 s x 7 h) = 1004 s; every 2.4 h is too rare.
    assert page.locator("#ri-tstar").inner_text().startswith("17 min")
    assert "T* is 17 min: save more often" in page.locator("#ri-verdict").inner_text()
    runbook = page.locator("#ri-checkpoints a.runbook-link")
    assert runbook.get_attribute("href") == "/runbooks/CheckpointCadence"
    assert page.locator(".run-tabs .tab-active").inner_text() == "Run"

    # Compare with the other run: the changed learning rate; it stays through a refresh.
    page.locator("#ri-compare").click()
    page.get_by_role("option", name=sc.OTHER).click()
    diff = page.locator("#ri-diff-result")
    diff.wait_for(timeout=10_000)
    assert "lr\t0.0003\t0.001" in diff.inner_text()
    # One live refresh (every 5 s), observed: the page's refresh callback answered.
    with page.expect_response(
        lambda r: (
            "_dash-update-component" in r.url
            and "ri-interval.n_intervals" in (r.request.post_data or "")
        ),
        timeout=20_000,
    ) as refresh:
        pass
    assert refresh.value.ok
    page.wait_for_timeout(300)  # Dash applies the answer to the page
    assert "0.001" in page.locator("#ri-diff-result").inner_text()
    screenshot(page, "run_info.png")
    # The dark theme redraws the bar in its colours, with no error.
    page.locator("#theme-toggle").click()
    page.wait_for_function("document.documentElement.dataset.theme === 'dark'")
    assert page.errors == []


def test_attempts_show_in_the_timeline(server: Server, page: Any) -> None:
    page.goto(f"{server.url}/runs/{sc.RUN}/timeline")
    row = page.locator("#tl-entries tr.tl-attempt", has_text="attempt 1 ended (exception)")
    row.wait_for(timeout=20_000)
    assert "tl-sev-critical" in (row.get_attribute("class") or "")
    assert page.locator("#tl-entries tr.tl-attempt", has_text="attempt 2 started").count() == 1
    assert page.errors == []


def test_a_run_without_identity_and_a_missing_run(server: Server, page: Any) -> None:
    page.goto(f"{server.url}/runs/{sc.OLD}/info")
    identity = page.locator("#ri-identity .notice")
    identity.wait_for(timeout=20_000)
    assert "no identity yet" in identity.inner_text() and "tw.init(config=" in identity.inner_text()
    assert page.locator("#ri-ettr").inner_text().endswith("%")  # goodput needs no identity
    assert "No checkpoints reported yet" in page.locator("#ri-checkpoints").inner_text()

    page.goto(f"{server.url}/runs/nope/info")
    missing = page.locator("#ri-notice .notice-error")
    missing.wait_for(timeout=20_000)
    assert "Run 'nope' not found" in missing.inner_text()
    assert page.errors == []
