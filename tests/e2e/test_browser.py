"""The dashboard in a real headless Chromium, served by a real ``trainwarden serve``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainwarden.agent import Agent, AgentConfig

from ..helpers import Server, start_serve, stop_serve

# The loss median's points on the run overview (its traces are named after what they draw).
MEDIAN_POINTS = (
    "(document.querySelector('#run-overview .js-plotly-plot').data || [])"
    ".filter(t => t.name === 'loss median').map(t => t.x.length)[0] || 0"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ui")
    server = start_serve(f"sqlite:///{tmp / 'ui.db'}", tmp / "serve.log")
    yield server
    stop_serve(server)


def agents(server: Server, run: str, world: int = 2) -> list[Agent]:
    return [
        Agent(
            AgentConfig.resolve(
                run=run, url=server.url, rank=r, world_size=world, flush_interval_s=0.1
            )
        )
        for r in range(world)
    ]


def train(ranks: list[Agent], steps: range) -> None:
    for step in steps:
        for rank, agent in enumerate(ranks):
            with agent.step(step, tokens=512) as s:
                s.loss(4.0 / (1 + step * 0.1) + 0.05 * rank)


def test_run_page_draws_the_loss_and_updates_live(server: Server, page) -> None:  # type: ignore[no-untyped-def]
    ranks = agents(server, "ui-live")
    train(ranks, range(20))
    for agent in ranks:
        agent._exporter.wake()  # type: ignore[union-attr]
    page.wait_for_timeout(500)

    page.goto(f"{server.url}/runs/ui-live")
    page.wait_for_selector("#run-overview .scatterlayer .trace", timeout=20_000)
    page.wait_for_function(f"{MEDIAN_POINTS} >= 20", timeout=10_000)
    # Every metric's series is its own query, side by side (load, in
    # webui/pages/overview/data.py): a figure drawn while the rollup commits may hold the
    # loss and not yet the throughput; the next refresh has both.
    names = "document.querySelector('#run-overview .js-plotly-plot').data.map(t => t.name)"
    both = "n.includes('tokens/s') && n.includes('data wait')"
    page.wait_for_function(f"(() => {{ const n = {names}; return {both}; }})()", timeout=10_000)
    # The header's first call follows the chart's (webui/first_graph.py).
    page.locator("#run-header", has_text="2 / 2").wait_for(timeout=10_000)
    if os.environ.get("TRAINWARDEN_SCREENSHOTS"):
        page.screenshot(
            path=str(Path(os.environ["TRAINWARDEN_SCREENSHOTS"]) / "run-page.png"), full_page=True
        )

    # New steps arrive while the page is open: the graph grows without a reload.
    train(ranks, range(20, 35))
    page.wait_for_function(f"{MEDIAN_POINTS} >= 35", timeout=15_000)
    for agent in ranks:
        agent.shutdown()
    assert page.errors == []


USER_TRACES = (
    "(() => { const gd = document.querySelector('#run-user .js-plotly-plot');"
    " return gd && gd.data ? gd.data.map(t => t.name) : []; })()"
)


def test_the_trainers_own_metrics_are_picked_and_drawn_on_the_run_page(
    server: Server, page
) -> None:  # type: ignore[no-untyped-def]
    ranks = agents(server, "ui-user")
    for step in range(12):
        for rank, agent in enumerate(ranks):
            with agent.step(step, tokens=512) as s:
                s.loss(2.0)
                s.lr(1e-3 * (1 + step))  # built in: offered first
                s.metric("aux", 0.1 * (rank + 1))
    for agent in ranks:
        agent.shutdown()
    page.goto(f"{server.url}/runs/ui-user")
    # Without a pick, the first metric offered is drawn: the learning rate.
    page.wait_for_function(f"{USER_TRACES}.includes('Learning rate median')", timeout=20_000)
    median = page.evaluate(
        "document.querySelector('#run-user .js-plotly-plot')"
        ".data.find(t => t.name === 'Learning rate median').y"
    )
    assert [round(v, 6) for v in median] == [round(1e-3 * (1 + i), 6) for i in range(12)]
    page.locator("#run-user-metric label", has_text="aux").click()
    page.wait_for_function(f"{USER_TRACES}.includes('aux median')", timeout=20_000)
    page.wait_for_function("() => location.search.includes('user=aux')", timeout=10_000)
    picked_aux = page.url
    page.locator("#run-user-metric label", has_text="Learning rate").click()
    page.wait_for_function(f"{USER_TRACES}.includes('Learning rate median')", timeout=20_000)
    page.wait_for_function("() => location.search.includes('user=lr')", timeout=10_000)
    if os.environ.get("TRAINWARDEN_SCREENSHOTS"):
        page.screenshot(
            path=str(Path(os.environ["TRAINWARDEN_SCREENSHOTS"]) / "run-user.png"), full_page=True
        )
    # The pick is in the address: a shared link opens on it.
    fresh = page.context.browser.new_page()
    fresh.goto(picked_aux)
    fresh.wait_for_function(f"{USER_TRACES}.includes('aux median')", timeout=20_000)
    fresh.close()
    assert page.errors == []


def test_runs_list_links_to_the_run(server: Server, page) -> None:  # type: ignore[no-untyped-def]
    ranks = agents(server, "ui-list", world=1)
    train(ranks, range(3))
    ranks[0].shutdown()
    page.goto(server.url + "/")
    link = page.locator("a.run-link", has_text="ui-list")
    link.wait_for(timeout=20_000)
    if os.environ.get("TRAINWARDEN_SCREENSHOTS"):
        page.screenshot(path=str(Path(os.environ["TRAINWARDEN_SCREENSHOTS"]) / "runs-page.png"))
    link.click()
    page.wait_for_url("**/runs/ui-list")
    page.wait_for_selector("#run-overview .scatterlayer .trace", timeout=20_000)
    assert page.errors == []


def test_an_unknown_run_shows_a_clear_state_not_a_traceback(server: Server, page) -> None:  # type: ignore[no-untyped-def]
    page.goto(server.url + "/runs/no-such-run")
    notice = page.locator("#run-notice .notice-error")
    notice.wait_for(timeout=20_000)
    assert "not found" in notice.inner_text()
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_the_top_bar_opens_the_nodes_page(server: Server, page) -> None:  # type: ignore[no-untyped-def]
    page.goto(f"{server.url}/")
    page.locator("header a.nav", has_text="Nodes").click()
    page.wait_for_function("() => location.pathname === '/nodes'", timeout=10_000)
    # No node of this server's runs has a finding: the page says so, once its callback ran.
    page.wait_for_selector("#nodes-table >> text=No node has findings", timeout=20_000)
    page.goto(f"{server.url}/nodes/gpu-03")
    page.wait_for_selector("#node-record >> text=No findings on node gpu-03", timeout=20_000)
    assert page.errors == []
