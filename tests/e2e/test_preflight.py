"""Issue 56's preflight, end to end: two 4-rank gloo jobs of the demo trainer (forked
warm, ``TRAINWARDEN_PREFLIGHT=1``, a node a rank). In one, the drill makes rank 2's
checks slow (``preflight=slow@rank=2``: its GEMM and copy really run twice per one
counted): rank 2 and its node are flagged before step 0, PreflightFailed fires and the
eviction policy's dry run names the node; the Ranks page shows it, in Chromium. The
other job passes, with no alert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ..helpers import Server, wait_for
from ..net import free_port
from .helpers import demo_ranks


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_slow_rank_fails_preflight_before_step_0_and_its_node_is_named(
    live_server: Server, tmp_path: Path, page: Any
) -> None:
    server = live_server
    stem = f"pre-{free_port()}"
    slow, fine = f"{stem}-slow", f"{stem}-fine"
    procs = []
    for run, drill in ((slow, "preflight=slow@rank=2"), (fine, "")):
        procs += demo_ranks(
            server,
            run,
            world=4,
            drill=drill,
            steps=3000,
            work_ms=30,  # on (until killed) while the alert engine sees the verdict
            logs=tmp_path,
            env={"TRAINWARDEN_PREFLIGHT": "1"},
            per_rank=lambda rank: {"NODE_NAME": f"node-{rank}"},
        )
    try:
        check(server, slow, fine, page)
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


def check(server: Server, slow: str, fine: str, page: Any) -> None:
    def preflight(run: str) -> dict[str, Any]:
        return server.get(f"/api/v1/runs/{run}/preflight").json()  # type: ignore[no-any-return]

    def all_in(run: str) -> bool:
        got = server.get(f"/api/v1/runs/{run}/preflight")  # 404 until the run exists
        return got.status_code == 200 and len(got.json()["ranks"]) == 4

    wait_for(lambda: all_in(slow) and all_in(fine), 120, "every rank's preflight")
    got = preflight(slow)
    assert [r["rank"] for r in got["ranks"]] == [0, 1, 2, 3], got
    assert got["failed"] == [2], got
    two = got["ranks"][2]
    assert two["node"] == "node-2" and two["drill"] == "preflight=slow"
    assert two["ratios"]["gemm_flops"] < 0.85 and two["ratios"]["copy_bytes_per_s"] < 0.85
    assert two["reasons"] == [f"GEMM at {two['ratios']['gemm_flops']:.2f}x the median rank's"]
    assert two["allreduce_bytes_per_s"] > 0 and two["group_size"] == 4
    assert all(r["device"] == "cpu" and r["dtype"] == "float32" for r in got["ranks"])
    assert preflight(fine)["failed"] == []

    def fired(run: str) -> list[dict[str, Any]]:
        alerts = server.get("/api/v1/alerts", run=run, rule="PreflightFailed").json()
        return alerts  # type: ignore[no-any-return]

    wait_for(lambda: fired(slow), 60, "PreflightFailed")
    (alert,) = fired(slow)
    assert (alert["rank"], alert["node"]) == (2, "node-2"), alert
    assert "GEMM at" in alert["annotations"]["description"]
    assert fired(fine) == []
    wait_for(
        lambda: [
            a
            for a in server.get("/api/v1/actions", run=slow).json()
            if a["kind"] == "evict" and a["node"] == "node-2" and a["mode"] == "dry-run"
        ],
        30,
        "the eviction's dry run naming node-2",
    )

    page.goto(f"{server.url}/runs/{slow}/ranks")
    page.wait_for_selector(
        "#ranks-preflight >> text=1 of 4 ranks failed preflight: 2", timeout=30_000
    )
    assert page.locator("#ranks-preflight tr.preflight-failed").count() == 1
    assert page.errors == []
