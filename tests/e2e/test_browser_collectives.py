"""Which rank, which collective, in a real headless Chromium served by a real ``trainwarden
serve``: four ranks stop completing steps (their heartbeats say so, and the collector's
health evaluator holds them hung); their Flight Recorder rings, sent through the ingest API
as the agent sends them, show rank 2 never issued collective #7 while ranks 0, 1 and 3
wait in it. The ranks page names rank 2 and highlights its row; the overview's banner
links there."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ..collector.helpers import batch
from ..helpers import Server, start_serve, stop_serve, wait_for
from .helpers import screenshot

RUN = "ui-hang"
CALM = "ui-calm"  # a run that is fine: no rings
WORLD = 4
CULPRIT = 2
STEPS = 5
T0 = time.time() - 60  # the steps ran a minute ago; none completed since
SECTION = "#ranks-collectives"


def ring(rank: int, now: float) -> dict[str, Any]:
    """The ``collectives`` event of ``rank`` (``agent/flight.py``'s form): rank 2 issued
    all-reduces 1..6, all completed; the others also issued #7 and wait in it."""
    last = 6 if rank == CULPRIT else 7
    entries = [
        {
            "seq": seq,
            "op": "all_reduce",
            "in_sizes": [[1024]],
            "in_dtypes": ["Float"],
            "out_sizes": [[1024]],
            "out_dtypes": ["Float"],
            "state": "completed" if seq < 7 else "scheduled",
            "done": seq < 7,
            "created": T0 + seq,
            "started": None,
            "completed": None,
        }
        for seq in range(1, last + 1)
    ]
    data = {
        "trigger": "stalled",
        "request": None,
        "available": True,
        "reason": None,
        "dumped_at": now,
        "groups": [
            {
                "pg": "0",
                "desc": "default_pg",
                "ranks": list(range(WORLD)),
                "entries": entries,
                "last_enqueued": last,
                "last_completed": 6,
                "dropped": 0,
            }
        ],
    }
    return {"id": f"collectives-{rank}", "kind": "collectives", "ts": now, "data": data}


def report(server: Server, rank: int, **parts: Any) -> None:
    """One request of ``rank``'s agent: its heartbeat says its last step ended at the end
    of step STEPS - 1, a minute ago, and it is inside a step since (in backward)."""
    body = batch(RUN, rank=rank, world_size=WORLD, **parts)
    body["agent"].update(
        sent_at=time.time(),
        heartbeat_s=2.0,  # beats every 0.5 s: dead only after 4.5 s of silence (a busy host)
        last_step=STEPS - 1,
        last_step_end=T0 + STEPS,
        in_step=True,
        phase="backward",
    )
    response = httpx.post(f"{server.url}/api/v1/ingest", json=body, timeout=10)
    assert response.status_code == 200, response.text


def steps() -> list[dict[str, Any]]:
    return [
        {"step": n, "ts": T0 + n, "duration_s": 0.1, "data_wait_s": 0.01, "tokens": 512}
        for n in range(STEPS)
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("ui-hang")
    server = start_serve(f"sqlite:///{tmp / 'ui.db'}", tmp / "serve.log")
    stop = threading.Event()
    beats = threading.Thread(target=heartbeats, args=(server, stop), daemon=True)
    try:
        now = time.time()
        for rank in range(WORLD):
            report(server, rank, steps=steps(), events=[ring(rank, now)])
        calm = batch(CALM, rank=0, world_size=1, steps=steps())
        assert httpx.post(f"{server.url}/api/v1/ingest", json=calm, timeout=10).status_code == 200
        beats.start()
        yield server
    finally:
        stop.set()
        if beats.is_alive():
            beats.join(5)
        stop_serve(server)


def heartbeats(server: Server, stop: threading.Event) -> None:
    """The hung ranks' agents still beat (an exporter thread is not the stuck training
    thread): alive, hung, not dead."""
    while not stop.wait(0.5):
        for rank in range(WORLD):
            try:
                report(server, rank)
            except Exception:  # the server is stopping; the test says what went wrong
                return


def verdict(server: Server) -> dict[str, Any] | None:
    found = server.get(f"/api/v1/runs/{RUN}/collectives").json().get("verdict") or {}
    return found if found.get("kind") == "culprit" else None


def hung(server: Server) -> bool:
    ranks = server.get(f"/api/v1/runs/{RUN}").json().get("ranks") or []
    return len(ranks) == WORLD and all(r["state"] == "hung" for r in ranks)


def test_the_ranks_page_names_the_rank_that_never_entered_the_collective(
    server: Server, page: Any
) -> None:
    wait_for(lambda: hung(server), 30, "four hung ranks")
    found = wait_for(lambda: verdict(server), 20, "a culprit verdict")
    assert found["culprits"] == [CULPRIT] and found["victims"] == [0, 1, 3]

    page.goto(f"{server.url}/runs/{RUN}/ranks")
    summary = page.locator(f"{SECTION} .coll-summary")
    summary.wait_for(timeout=20_000)
    said = summary.inner_text()
    assert said.startswith(f"rank {CULPRIT} (node node{CULPRIT}) never entered all_reduce #7"), said
    assert page.locator(f"{SECTION} .coll-summary span.coll-culprit").inner_text() == "rank 2"
    rows = page.locator(f"{SECTION} tr.coll-row")
    assert rows.count() == WORLD
    assert rows.first.get_attribute("data-rank") == str(CULPRIT)  # the culprit first
    culprit = page.locator(f'{SECTION} tr.coll-row[data-rank="{CULPRIT}"]')
    assert "coll-culprit" in (culprit.get_attribute("class") or "").split()
    cells = culprit.locator("td").all_inner_texts()
    assert cells[2] == "6" and cells[-1] == "culprit", cells
    for rank in (0, 1, 3):
        victim = page.locator(f'{SECTION} tr.coll-row[data-rank="{rank}"]')
        assert "coll-victim" in (victim.get_attribute("class") or "").split()
        assert victim.locator("td").nth(2).inner_text() == "7"
    # The culprit's colour is the highlighted one, not the table's plain background.
    colours = page.evaluate(
        """() => [2, 0].map(r => getComputedStyle(document.querySelector(
            `#ranks-collectives tr.coll-row[data-rank="${r}"] td`)).backgroundColor)"""
    )
    assert colours[0] != colours[1], colours
    # The states table says so too: the evaluator took the verdict's roles.
    page.locator(f"#ranks-row-{CULPRIT}", has_text="culprit").wait_for(timeout=20_000)
    screenshot(page, "collectives.png")

    # Nothing at the bottom of the page: the section, above, says it all.
    assert page.locator("#ranks-coll-bottom").inner_text() == ""
    # "Read collectives again" asks every rank (auth off: anyone may); the answer is by it.
    page.get_by_role("button", name="Read collectives again").click()
    page.locator("#ranks-coll-feedback-top", has_text="Asked its 4 ranks").wait_for(timeout=10_000)
    assert server.get(f"/api/v1/runs/{RUN}/collectives").json()["requested_at"] is not None
    assert "Traceback" not in page.content()
    assert page.errors == []


def test_the_overview_banner_links_to_the_collectives(server: Server, page: Any) -> None:
    wait_for(lambda: hung(server) and verdict(server), 30, "hung ranks and a verdict")
    page.goto(f"{server.url}/runs/{RUN}")
    banner = page.locator("#run-hang-banner")
    banner.wait_for(timeout=20_000)
    assert f"rank {CULPRIT} (node node{CULPRIT}) never entered all_reduce #7" in (
        banner.inner_text()
    )
    banner.locator("a", has_text="which rank, which collective").click()
    page.wait_for_url(f"**/runs/{RUN}/ranks#ranks-collectives", timeout=10_000)
    page.locator(f'{SECTION} tr.coll-culprit[data-rank="{CULPRIT}"]').wait_for(timeout=20_000)
    # Drawn after the page, the section is scrolled to: its top is on the screen.
    page.wait_for_function(
        "() => { const r = document.querySelector('#ranks-collectives').getBoundingClientRect();"
        " return r.top >= 0 && r.top < window.innerHeight; }",
        timeout=10_000,
    )
    assert page.errors == []


def test_a_run_without_rings_has_one_quiet_line_at_the_bottom(server: Server, page: Any) -> None:
    page.goto(f"{server.url}/runs/{CALM}/ranks")
    quiet = page.locator("#ranks-coll-bottom .coll-quiet")
    quiet.wait_for(timeout=20_000)
    assert "No collectives read yet: they are read when a rank hangs." in quiet.inner_text()
    assert page.locator(SECTION).inner_text() == ""  # nothing above the heatmaps
    page.get_by_role("button", name="Read collectives now").click()
    page.locator("#ranks-coll-feedback-bottom", has_text="Asked its only rank").wait_for(
        timeout=10_000
    )
    quiet.filter(has_text="Asked the ranks at").wait_for(timeout=10_000)
    assert page.errors == []
