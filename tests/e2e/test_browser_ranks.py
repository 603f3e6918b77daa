"""The ranks and hardware pages in a real headless Chromium, served by a real
``trainwarden serve``, on a run of four real agents with drills: rank 2 is a straggler
(its steps really take 3x as long), rank 0's GPU overheats, rank 1's raises XID 79."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from trainwarden.agent import Agent, AgentConfig
from trainwarden.agent.gpu import describe_xid
from trainwarden.webui.pages.ranks.query import parse_query

from ..helpers import Server, start_serve, stop_serve
from .helpers import screenshot

RUN = "ui-ranks"
WORLD = 4
SLOW_RANK = 2
STEPS = 48
DRILL = f"slow=3x@rank={SLOW_RANK},steps=0-{STEPS};thermal=92C@rank=0,step=5;xid=79@rank=1,step=10"

# The heatmap's rows and cells as drawn: plotly.js keeps typed arrays as {bdata, dtype}.
HEATMAP = """sel => {
    const gd = document.querySelector(sel + ' .js-plotly-plot');
    if (!gd || !gd.data || !gd.data.length || gd.data[0].type !== 'heatmap') return null;
    return JSON.stringify({y: Array.from(gd.data[0].y), z: gd.data[0].z,
                           title: gd.layout.title && gd.layout.title.text});
}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ui-ranks")
    server = start_serve(f"sqlite:///{tmp / 'ui.db'}", tmp / "serve.log")
    seed(server)
    yield server
    stop_serve(server)


def seed(server: Server) -> None:
    """Four ranks train in lockstep; every step does 10 ms of real work."""
    ranks = [
        Agent(
            AgentConfig.resolve(
                run=RUN,
                url=server.url,
                rank=r,
                world_size=WORLD,
                flush_interval_s=0.1,
                drill=DRILL,
                gpu_interval_s=0.2,
            )
        )
        for r in range(WORLD)
    ]
    for step in range(STEPS):
        for rank, agent in enumerate(ranks):
            with agent.step(step, tokens=512) as s:
                time.sleep(0.01)
                s.loss(4.0 / (1 + step * 0.1) + 0.01 * rank)
                s.metric("moe.load", 2.0 if rank == 3 else 1.0)  # rank 3's experts get 2x
                s.metric("eval.acc", 0.5)
    time.sleep(1.0)  # a few GPU readings after the last step
    for agent in ranks:
        agent.shutdown()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        run = server.get(f"/api/v1/runs/{RUN}").json()
        if run.get("last_step") == STEPS - 1 and len(run.get("ranks", [])) == WORLD:
            return
        time.sleep(0.2)
    raise AssertionError(f"the seeded run did not arrive: {run}")


def heatmap(page: Any, graph: str) -> dict[str, Any]:
    """The drawn heatmap of ``#graph``: its rank rows and its cells (gaps as None)."""
    handle = page.wait_for_function(HEATMAP, arg=f"#{graph}", timeout=20_000)
    found = json.loads(handle.json_value())
    z = found["z"]
    if isinstance(z, dict):  # a typed array on the wire
        import numpy as np

        rows, cols = (int(n) for n in str(z["shape"]).split(","))
        flat = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"])
        z = [
            [None if np.isnan(v) else float(v) for v in flat[i * cols : (i + 1) * cols]]
            for i in range(rows)
        ]
    found["z"] = z
    return found


def row_means(found: dict[str, Any]) -> dict[int, float]:
    out = {}
    for rank, row in zip(found["y"], found["z"], strict=True):
        cells = [v for v in row if v is not None]
        out[int(rank)] = sum(cells) / len(cells)
    return out


def test_the_straggler_is_a_stripe_on_its_rank_row(server: Server, page: Any) -> None:
    page.goto(f"{server.url}/runs/{RUN}/ranks")
    found = heatmap(page, "ranks-step_time")
    assert sorted(found["y"]) == list(range(WORLD))
    means = row_means(found)
    slowest = max(means, key=lambda r: means[r])
    assert slowest == SLOW_RANK, means
    others = [v for r, v in means.items() if r != SLOW_RANK]
    assert means[SLOW_RANK] > 2 * max(others), means  # 3x drill: a stripe, not noise
    assert f"rank {SLOW_RANK} (" in found["title"]  # the title names it
    # The other heatmaps draw too: loss deviation (centred on 0) and GPU temperature.
    heatmap(page, "ranks-loss_dev")
    temps = heatmap(page, "ranks-gpu_temp")
    hottest = max(row_means(temps).items(), key=lambda kv: kv[1])[0]
    assert hottest == 0  # the thermal drill heated rank 0's GPU
    page.locator("#ranks-states .rank-row").first.wait_for(timeout=10_000)
    assert page.locator("#ranks-states .rank-row").count() == WORLD
    screenshot(page, "ranks.png")
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_a_user_metric_is_picked_and_drawn_per_rank(server: Server, page: Any) -> None:
    page.goto(f"{server.url}/runs/{RUN}/ranks")
    first = heatmap(page, "ranks-user")  # the first of the run's user metrics, by name
    assert first["title"].startswith("User metric eval.acc") and sorted(first["y"]) == [0, 1, 2, 3]
    page.locator("#ranks-user-metric label", has_text="moe.load").click()
    page.wait_for_function(
        "() => { const gd = document.querySelector('#ranks-user .js-plotly-plot');"
        " return gd && gd.layout.title && gd.layout.title.text.includes('moe.load'); }",
        timeout=20_000,
    )
    found = heatmap(page, "ranks-user")
    assert "stands out: rank 3 (2.0× its peers)" in found["title"]
    assert row_means(found) == {0: 1.0, 1: 1.0, 2: 1.0, 3: 2.0}
    page.wait_for_function("() => location.search.includes('user=moe.load')", timeout=10_000)
    # The pick is in the address: shared, it opens on the same metric.
    fresh = page.context.browser.new_page()
    fresh.goto(page.url)
    shared = heatmap(fresh, "ranks-user")
    assert shared["title"].startswith("User metric moe.load")
    fresh.close()
    assert page.errors == []


def test_clicking_a_rank_shows_its_detail_and_keeps_it_in_the_url(
    server: Server, page: Any
) -> None:
    page.goto(f"{server.url}/runs/{RUN}/ranks")
    heatmap(page, "ranks-step_time")
    page.locator("#ranks-states .rank-row").first.wait_for(timeout=10_000)  # layout settled
    # A click on the slow rank's row of the heatmap (the middle of its row, by the axes).
    box = page.evaluate(
        """rank => {
        const gd = document.querySelector('#ranks-step_time .js-plotly-plot');
        const L = gd._fullLayout, r = gd.getBoundingClientRect();
        return {x: r.left + L._size.l + L._size.w / 2,
                y: r.top + L._size.t + L.yaxis.l2p(rank)};
    }""",
        SLOW_RANK,
    )
    # The heatmaps refresh live; one click, and it holds.
    page.mouse.click(box["x"], box["y"])
    page.wait_for_url(f"**/runs/{RUN}/ranks?rank={SLOW_RANK}", timeout=20_000)
    detail = page.locator("#ranks-detail .rank-detail")
    detail.wait_for(timeout=10_000)
    assert f"Rank {SLOW_RANK}" in detail.inner_text()
    page.wait_for_selector("#ranks-rank-graph .scatterlayer .trace", timeout=10_000)

    # A rank number in the table does the same; the URL is shareable.
    page.locator("#ranks-row-1 a.rank-link").click()
    page.wait_for_url(f"**/runs/{RUN}/ranks?rank=1", timeout=10_000)
    page.locator("#ranks-detail h3", has_text="Rank 1").wait_for(timeout=10_000)
    # A drag across steps zooms: the range goes to the URL, the rank stays, and the
    # collector re-buckets just those steps.
    ends = page.evaluate(
        """() => {
        const gd = document.querySelector('#ranks-step_time .js-plotly-plot');
        const L = gd._fullLayout, r = gd.getBoundingClientRect();
        const y = r.top + L._size.t + L._size.h / 2;
        return [r.left + L._size.l + L.xaxis.l2p(20), r.left + L._size.l + L.xaxis.l2p(30), y];
    }"""
    )
    page.mouse.move(ends[0], ends[2])
    page.mouse.down()
    page.mouse.move(ends[1], ends[2], steps=8)
    page.mouse.up()
    page.wait_for_url("**/ranks?rank=1&from=*&to=*", timeout=10_000)
    _, lo, hi = parse_query(page.url.split("?", 1)[1])
    assert lo is not None and hi is not None and 18 <= lo <= 22 and 28 <= hi <= 32
    page.wait_for_function(
        f"(() => {{ const gd = document.querySelector('#ranks-step_time .js-plotly-plot');"
        f" return gd && gd.data[0] && gd.data[0].x.length === {hi - lo + 1}; }})()",
        timeout=10_000,
    )

    # Opened afresh (a shared link), the URL's rank and step range are what is shown.
    page.goto(f"{server.url}/runs/{RUN}/ranks?rank=3&from=10&to=30")
    page.locator("#ranks-detail h3", has_text="Rank 3").wait_for(timeout=20_000)
    found = heatmap(page, "ranks-step_time")
    assert len(found["z"][0]) == 21  # steps 10..30, one per column

    # A rank that is not in the run says so.
    page.goto(f"{server.url}/runs/{RUN}/ranks?rank=9")
    page.locator("#ranks-detail .notice-error", has_text="Rank 9 has not reported").wait_for(
        timeout=20_000
    )
    assert page.errors == []


def test_hardware_page_lists_the_xid_with_its_meaning_and_the_hot_gpu(
    server: Server, page: Any
) -> None:
    page.goto(f"{server.url}/runs/{RUN}/hardware")
    xid = page.locator("#hw-xids .xid-row", has_text="XID 79")
    xid.wait_for(timeout=20_000)
    meaning = describe_xid(79)["meaning"]
    assert meaning in xid.inner_text()
    assert (
        "reboot" in xid.inner_text() or "reset" in xid.inner_text() or "drain" in xid.inner_text()
    )
    hot = page.locator("#hw-gpu-0")
    hot.wait_for(timeout=10_000)
    assert "92 °C" in hot.inner_text() and "throttled" in hot.inner_text()
    assert page.locator("#hw-gpus tr[id^=hw-gpu-]").count() == WORLD
    page.wait_for_selector("#hw-temp .scatterlayer .trace", timeout=10_000)
    screenshot(page, "hardware.png")

    # Narrowed to one GPU by the URL (the ranks page's detail links here).
    page.goto(f"{server.url}/runs/{RUN}/hardware?rank=1")
    page.locator("#hw-notice", has_text="rank 1's GPU only").wait_for(timeout=20_000)
    page.locator("#hw-xids .xid-row", has_text="XID 79").wait_for(timeout=10_000)
    assert page.locator("#hw-gpus tr[id^=hw-gpu-]").count() == 1
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_a_missing_run_shows_a_clear_notice_on_both_pages(server: Server, page: Any) -> None:
    for tab, box in (("ranks", "#ranks-notice"), ("hardware", "#hw-notice")):
        page.goto(f"{server.url}/runs/no-such-run/{tab}")
        page.locator(f"{box} .notice-error", has_text="not found").wait_for(timeout=20_000)
        assert "Traceback" not in page.content()
    assert page.errors == []


def test_dark_theme_redraws_the_heatmaps(server: Server, page: Any) -> None:
    page.goto(f"{server.url}/runs/{RUN}/ranks")
    heatmap(page, "ranks-step_time")
    page.click("#theme-toggle")
    page.wait_for_function(
        "document.querySelector('#ranks-step_time .js-plotly-plot')"
        ".layout.template.layout.paper_bgcolor === 'rgb(17,17,17)'",
        timeout=10_000,
    )
    assert page.errors == []
