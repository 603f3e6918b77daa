"""The run overview in a real headless Chromium, served by a real ``trainwarden serve``: a
seeded run of 3 ranks with a loss spike, a checkpoint, a restart and a firing alert."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest

from trainwarden.webui.plotly_js import BUNDLE
from trainwarden.webui.polyfill import RUNTIME

from ..collector.helpers import batch
from ..helpers import Server, start_serve, stop_serve, wait_for

RUN = "ui-overview"
WORLD = 3
SPIKE = (40, 2)  # (step, rank) of the loss spike
T0 = time.time() - 600  # the steps' wall clock: in the past (the collector refuses the future)
PLOT = "document.querySelector('#run-overview .js-plotly-plot')"
# The x-range of each of the figure's six rows, as drawn now.
X_RANGES = (
    f"[1, 2, 3, 4, 5, 6].map(i => {PLOT}._fullLayout['xaxis' + (i > 1 ? i : '')].range.map(Number))"
)
MEDIAN_POINTS = (
    f"(({PLOT} || {{}}).data || [])"
    ".filter(t => t.name === 'loss median').map(t => t.x.length)[0] || 0"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("overview")
    server = start_serve(f"sqlite:///{tmp / 'ui.db'}", tmp / "serve.log")
    yield server
    stop_serve(server)


def a_step(n: int, rank: int) -> dict[str, Any]:
    loss = 4.0 / (1 + n * 0.1) + 0.05 * rank
    spike = (n, rank) == SPIKE
    row: dict[str, Any] = {
        "step": n,
        "ts": T0 + n,
        "duration_s": 0.1 + 0.01 * rank,
        "data_wait_s": 0.01,
        "tokens": 512,
        "loss": 30.0 if spike else loss,
        "grad_norm": 1.0 + 0.01 * (n % 7),
        "compute_s": 0.07,
        "overlapped_comm_s": 0.02,
        "exposed_comm_s": 0.02,
    }
    if spike:
        row["flags"] = ["loss_spike"]
    return row


def send(
    server: Server, steps: range, events: dict[int, list[dict[str, Any]]] | None = None
) -> None:
    for rank in range(WORLD):
        body = batch(
            RUN,
            rank=rank,
            world_size=WORLD,
            steps=[a_step(n, rank) for n in steps],
            events=(events or {}).get(rank, []),
        )
        now = time.time()
        body["agent"].update(sent_at=now, heartbeat_s=2.0, last_step=steps[-1], last_step_end=now)
        response = httpx.post(f"{server.url}/api/v1/ingest", json=body, timeout=10)
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def seeded(server: Server) -> Server:
    """Steps 0..59 of 3 ranks; a checkpoint at step 20, a restart of rank 0 at step 30 and
    an XID 79 on rank 1 at step 50, reported now (FatalXid fires; the alert engine reads
    recent events only)."""
    events = {
        0: [
            {
                "id": "ckpt-20",
                "kind": "checkpoint",
                "ts": T0 + 20.5,
                "step": 20,
                "data": {"path": "/ckpt/step-20"},
            },
            {"id": "restart-30", "kind": "restart", "ts": T0 + 30.2, "step": 30},
        ],
        1: [
            {
                "id": "xid-50",
                "kind": "xid",
                "ts": time.time(),
                "step": 50,
                "severity": "critical",
                "data": {"code": 79},
            }
        ],
    }
    send(server, range(60), events)
    wait_for(
        lambda: server.get("/api/v1/alerts", run=RUN, rule="FatalXid", state="firing").json(),
        20,
        "FatalXid firing",
    )
    return server


def open_overview(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_selector(
        "#run-overview .scatterlayer .trace path", state="attached", timeout=20_000
    )


def names(page: Any) -> list[str]:
    return page.evaluate(f"{PLOT}.data.map(t => t.name)")


def test_overview_draws_every_row_with_markers_and_updates_live(seeded: Server, page: Any) -> None:
    requested: list[str] = []
    page.on("request", lambda r: requested.append(r.url.split("?")[0]))
    open_overview(page, f"{seeded.url}/runs/{RUN}")
    # plotly.js is the custom bundle, never Dash's full one (4.8 MB, 0.8 s to evaluate).
    scripts = [u for u in requested if "plotly" in u]
    assert scripts and all(u.endswith(f"/assets/{BUNDLE}") for u in scripts), scripts
    # regenerator-runtime, not @babel/polyfill (webui/polyfill.py); the page draws without it.
    assert any(u.endswith(f"/assets/{RUNTIME}") for u in requested), requested
    assert not any("polyfill@" in u for u in requested), requested
    page.wait_for_function(f"{MEDIAN_POINTS} >= 60", timeout=15_000)
    drawn = names(page)
    for name in (
        "tokens/s",
        "MFU",
        "loss median",
        "grad norm median",
        "compute",
        "exposed comm",
        "overlapped comm",
        "data wait",
        "loss spike",
        "rank 2",
        "checkpoint",
        "restart",
        "alert",
    ):
        if name == "MFU":
            continue  # no FLOPs reported: the row says how to get MFU instead
        assert name in drawn, (name, drawn)
    assert "No MFU" in page.locator("#run-overview").inner_text()
    spike = page.evaluate(f"{PLOT}.data.find(t => t.name === 'loss spike')")
    assert spike["x"] == [SPIKE[0]] and "rank 2" in spike["text"][0]
    # (Other alerts may fire later: these ranks stop heartbeating once seeded.)
    alerts = page.evaluate(
        f"{PLOT}.data.filter(t => t.name === 'alert')"
        ".flatMap(t => t.x.map((x, i) => [x, t.text[i]]))"
    )
    assert [50, "alert FatalXid rank 1 (critical, firing)"] in alerts, alerts
    page.locator("#run-header", has_text="3 / 3").wait_for(timeout=10_000)  # after the chart
    assert "Whole run: steps 0–59" in page.locator("#run-range").inner_text()
    if os.environ.get("TRAINWARDEN_SCREENSHOTS"):
        page.wait_for_timeout(500)
        shots = Path(os.environ["TRAINWARDEN_SCREENSHOTS"])
        page.screenshot(path=str(shots / "overview.png"), full_page=True)

    # New steps arrive while the page is open: every row grows without a reload.
    send(seeded, range(60, 80))
    page.wait_for_function(f"{MEDIAN_POINTS} >= 80", timeout=15_000)
    # (The collector rolls up tokens/s a moment after the loss.)
    page.wait_for_function(
        f"{PLOT}.data.find(t => t.name === 'tokens/s').x.length >= 80", timeout=15_000
    )
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_a_range_selection_zooms_every_row_and_goes_into_the_url(seeded: Server, page: Any) -> None:
    open_overview(page, f"{seeded.url}/runs/{RUN}")
    page.wait_for_function(f"{MEDIAN_POINTS} >= 60", timeout=15_000)
    # What a drag across the loss row does: a relayout of its x-axis, once, right after the
    # first draw, while refreshes redraw the chart and the metric picker's first answer
    # may still call the URL callback (such a call once made Dash drop the drag's answer,
    # and the drag was lost in loaded CI runs: the newest drag is now applied by any call).
    page.evaluate(f"Plotly.relayout({PLOT}, {{'xaxis4.range[0]': 10.2, 'xaxis4.range[1]': 29.7}})")
    page.wait_for_function("location.search.includes('from=10')", timeout=20_000)
    query = parse_qs(page.evaluate("location.search").lstrip("?"))
    assert query["from"] == ["10"] and query["to"] == ["30"]
    # The range is read again at full detail: the median holds exactly steps 10..30.
    page.wait_for_function(f"{MEDIAN_POINTS} === 21", timeout=10_000)
    page.wait_for_function(f"{X_RANGES}.every(r => r[0] === 10 && r[1] === 30)", timeout=10_000)
    assert "Steps 10–30" in page.locator("#run-range").inner_text()
    # Markers outside the range are left out; the restart at step 30 is in it.
    assert "restart" in names(page) and "alert" not in names(page)  # the alerts: steps 50, 59

    # "Whole run" shows every step again and clears the range from the URL. (20 s: each
    # wait is a round of callbacks, which once took over 10 s with the full suite
    # loading both cores.)
    page.click("#run-reset")
    page.wait_for_function(f"{MEDIAN_POINTS} >= 60", timeout=20_000)
    page.wait_for_function("!location.search.includes('from=')", timeout=20_000)
    page.wait_for_function(f"{X_RANGES}.every(r => r[0] <= 0 && r[1] >= 59)", timeout=20_000)

    # Back in the browser's history: the range comes back.
    page.go_back()
    page.wait_for_function(f"{MEDIAN_POINTS} === 21", timeout=20_000)
    assert page.errors == []


def test_a_shared_link_opens_zoomed_on_the_time_axis_with_its_rank(
    seeded: Server, page: Any
) -> None:
    open_overview(page, f"{seeded.url}/runs/{RUN}?from=35&to=45&axis=time&rank=1")
    page.wait_for_function(f"{MEDIAN_POINTS} === 11", timeout=15_000)
    assert page.is_checked("#run-axis input[value=time]")
    assert page.input_value("#run-rank") == "1"
    drawn = names(page)
    assert "rank 1" in drawn and "rank 2" in drawn  # the link's rank, and the spiking one
    axis = page.evaluate(f"{PLOT}._fullLayout.xaxis.type")
    assert axis == "date"
    # Switching back to steps keeps the range, and the URL says so.
    page.click("#run-axis input[value=step]")
    page.wait_for_function("!location.search.includes('axis=time')", timeout=10_000)
    page.wait_for_function(f"{PLOT}._fullLayout.xaxis.type === 'linear'", timeout=10_000)
    page.wait_for_function(f"{X_RANGES}.every(r => r[0] === 35 && r[1] === 45)", timeout=10_000)
    search = page.evaluate("location.search")
    assert "from=35" in search and "rank=1" in search
    assert page.errors == []


def test_the_chart_is_asked_for_first_and_links_still_route(seeded: Server, page: Any) -> None:
    """The page opened is in Dash's layout (no routing callback at load), its chart's
    figure is the first callback sent, and the header's comes after the chart's answer;
    a link to another page still routes without a reload, and back again."""
    sent: list[tuple[str, str]] = []  # (what, the callback's outputs) in order

    def log(kind: str, r: Any) -> None:
        if "_dash-update-component" in r.url:
            sent.append((kind, str((r.post_data_json or {}).get("output", ""))))

    page.on("request", lambda r: log("sent", r))
    page.on("requestfinished", lambda r: log("done", r))
    open_overview(page, f"{seeded.url}/runs/{RUN}")
    page.locator("#run-header", has_text="3 / 3").wait_for(timeout=10_000)
    outputs = [out for kind, out in sent if kind == "sent"]
    assert not any("page.children" in out for out in outputs), outputs
    assert "run-overview.figure" in outputs[0], outputs
    header_sent = sent.index(next(e for e in sent if e[0] == "sent" and "run-header" in e[1]))
    chart_done = sent.index(next(e for e in sent if e[0] == "done" and "run-overview" in e[1]))
    assert chart_done < header_sent, sent
    # A tab is a dcc.Link: the routing callback draws the ranks page, in the same document.
    page.evaluate("window._sameDocument = true")
    page.get_by_role("link", name="Ranks").click()
    page.wait_for_selector("#ranks-step_time .hm image", state="attached", timeout=20_000)
    assert any("page.children" in out for kind, out in sent if kind == "sent")
    page.go_back()
    page.wait_for_selector("#run-overview .scatterlayer .trace path", state="attached")
    assert page.evaluate("window._sameDocument") is True
    assert page.errors == []


def test_a_missing_run_says_so(server: Server, page: Any) -> None:
    page.goto(f"{server.url}/runs/no-such-run?from=5&to=9")
    notice = page.locator("#run-notice .notice-error")
    notice.wait_for(timeout=20_000)
    assert "not found" in notice.inner_text() and "runs list" in notice.inner_text()
    page.locator("#run-overview", has_text="not found").wait_for(timeout=10_000)
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_an_empty_run_says_it_waits_for_steps(server: Server, page: Any) -> None:
    body = batch("ui-empty", rank=0, world_size=1, steps=[])
    assert httpx.post(f"{server.url}/api/v1/ingest", json=body, timeout=10).status_code == 200
    page.goto(f"{server.url}/runs/ui-empty")
    page.locator("#run-overview", has_text="No steps yet").wait_for(timeout=20_000)
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_a_small_mfu_reads_as_a_percentage_on_its_ticks_and_hover(
    server: Server, page: Any
) -> None:
    """MFU under 1 % (a CPU, a small model): the ticks keep two significant digits (a
    whole percent printed "0%" on every tick) and the hover says %, not an SI "4.5m"."""
    run, peak = "ui-mfu", 1e12
    mfu = [0.004 + 0.0005 * (n % 4) for n in range(30)]
    steps = [
        {
            "step": n,
            "ts": T0 + n,
            "duration_s": 0.1,
            "tokens": 512,
            "loss": 2.0,
            "flops": m * 0.1 * peak,
            "peak_flops": peak,
            "mfu": m,
        }
        for n, m in enumerate(mfu)
    ]
    body = batch(run, rank=0, world_size=1, steps=steps)
    assert httpx.post(f"{server.url}/api/v1/ingest", json=body, timeout=10).status_code == 200
    open_overview(page, f"{server.url}/runs/{run}")
    page.wait_for_function(
        f"({PLOT}.data || []).some(t => t.name === 'MFU' && t.x.length >= 29)", timeout=20_000
    )
    ticks = page.evaluate(
        "[...document.querySelectorAll('#run-overview .y3tick text')].map(t => t.textContent)"
    )
    assert len(ticks) >= 3 and all(t.endswith("%") for t in ticks), ticks
    assert len(set(ticks)) == len(ticks), ticks  # no two ticks read the same
    assert any(t.startswith("0.") for t in ticks), ticks  # e.g. 0.45%, not 0%
    hover = page.evaluate(f"{PLOT}.data.find(t => t.name === 'MFU').hovertemplate")
    assert "%{y:.2~p}" in hover, hover
    assert page.errors == []


def test_a_refresh_in_the_middle_of_a_drag_keeps_the_users_range(seeded: Server, page: Any) -> None:
    """A person drags across the loss row from step 20 to step 30; new steps arrive and a
    live refresh comes due while the mouse button is still down: the figure is not redrawn
    under the drag (the tick is held in the browser, webui/gestures.py); the drag ends: the
    range is the one the user drew, and the held refresh's steps are drawn within it."""
    open_overview(page, f"{seeded.url}/runs/{RUN}")
    page.wait_for_function(f"{MEDIAN_POINTS} >= 60", timeout=15_000)
    # (Steps 60..79 too when the test that sends them ran first.)
    last = seeded.get(f"/api/v1/runs/{RUN}").json()["last_step"]
    page.wait_for_function(f"{MEDIAN_POINTS} === {last + 1}", timeout=15_000)
    x0, x1, y = page.evaluate(
        f"""() => {{
        const gd = {PLOT}, L = gd._fullLayout, r = gd.getBoundingClientRect();
        const ax = L.xaxis4, ay = L.yaxis4;  // the loss row
        return [r.left + ax._offset + ax.l2p(20), r.left + ax._offset + ax.l2p(30),
                r.top + ay._offset + ay._length / 2];
    }}"""
    )
    page.mouse.move(x0, y)
    page.mouse.down()
    page.mouse.move((x0 + x1) / 2, y, steps=4)
    send(seeded, range(last + 1, last + 11))  # stored: a refresh from now on would draw them
    held = page.evaluate("window._twPointer.held")
    # A refresh came due with the new steps stored, the button still down: held back.
    page.wait_for_function(f"window._twPointer.held > {held}", timeout=20_000)
    assert page.evaluate(MEDIAN_POINTS) == last + 1  # not redrawn under the drag
    page.mouse.move(x1, y, steps=4)
    page.mouse.up()
    page.wait_for_function("location.search.includes('from=')", timeout=20_000)
    query = parse_qs(page.evaluate("location.search").lstrip("?"))
    lo, hi = int(query["from"][0]), int(query["to"][0])
    assert 18 <= lo <= 21 and 29 <= hi <= 31, query  # the steps the user dragged across
    # The drag's own redraw reads the run again: the new steps are drawn, in the user's range.
    page.wait_for_function(f"{MEDIAN_POINTS} === {last + 11}", timeout=20_000)
    page.wait_for_function(f"{X_RANGES}.every(r => r[0] === {lo} && r[1] === {hi})", timeout=20_000)
    assert page.errors == []
