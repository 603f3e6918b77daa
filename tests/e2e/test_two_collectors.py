"""Two collectors on one PostgreSQL: ingest through either, one rollup and one health
verdict per fact (advisory locks), not two."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from ..collector.helpers import batch, step
from ..conftest import empty_tables, start_serve, stop_serve


def test_two_collectors_share_one_database(pg_url: str, tmp_path: Path) -> None:
    a = start_serve(pg_url, tmp_path / "a.log")
    b = start_serve(pg_url, tmp_path / "b.log")
    try:
        now = time.time()
        for i in range(20):
            for rank in range(4):
                if rank == 3 and i >= 10:
                    continue  # rank 3 goes silent after step 9
                server = a if rank < 2 else b
                body = batch("shared", rank=rank, world_size=4, steps=[{**step(i), "ts": now + i}])
                body["agent"].update(
                    heartbeat_s=1.0, last_step=i, last_step_end=time.time(), sent_at=time.time()
                )
                assert httpx.post(server.url + "/api/v1/ingest", json=body).status_code == 200
            time.sleep(0.05)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ranks = {r["rank"]: r["state"] for r in a.get("/api/v1/runs/shared/ranks").json()}
            if ranks.get(3) == "dead":
                break
            time.sleep(0.3)
        assert ranks[3] == "dead"
        while time.monotonic() < deadline:  # steps 10+ wait out the grace for rank 3
            series = b.get("/api/v1/runs/shared/series", metric="step_time").json()
            if len(series["step"]) == 20:
                break
            time.sleep(0.3)
        assert series["step"] == list(range(20))
        assert (
            series["n"] == [4] * 10 + [3] * 10
        )  # steps 10+ rolled up after the grace, without rank 3
        dead = [
            e
            for e in a.get("/api/v1/runs/shared/events", kind="rank_state").json()
            if e["rank"] == 3 and e["data"]["to"] == "dead"
        ]
        assert len(dead) == 1  # one evaluator at a time: one verdict, not two
    finally:
        stop_serve(a)
        stop_serve(b)
        empty_tables(pg_url)
