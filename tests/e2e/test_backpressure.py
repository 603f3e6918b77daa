"""A slow database makes the collector refuse (503 + Retry-After), not queue without end."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import httpx

from ..collector.helpers import batch, step
from ..helpers import start_serve, stop_serve


def test_a_blocked_database_gets_503_with_retry_after_and_nothing_is_lost(tmp_path: Path) -> None:
    db = tmp_path / "slow.db"
    server = start_serve(
        f"sqlite:///{db}", tmp_path / "serve.log", env={"TRAINWARDEN_MAX_INFLIGHT_INGEST": "2"}
    )
    try:
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # hold the write lock: ingest waits on it
        results: dict[int, int] = {}

        def post(rank: int) -> None:
            body = batch(rank=rank, world_size=8, steps=[step(0)])
            results[rank] = httpx.post(
                server.url + "/api/v1/ingest", json=body, timeout=60
            ).status_code

        first = [threading.Thread(target=post, args=(r,)) for r in (0, 1)]
        for t in first:
            t.start()
        # Both are past the gate and unanswered (the in-flight gauge; the writer's queue
        # gauge was no sure sign: their rows may already be with the writer, seen in CI).
        deadline = time.monotonic() + 30
        while "trainwarden_ingest_in_flight 2.0" not in server.get("/metrics").text:
            assert time.monotonic() < deadline, "the two requests never were in flight"
            time.sleep(0.05)
        response = httpx.post(
            server.url + "/api/v1/ingest", json=batch(rank=2, world_size=8, steps=[step(0)])
        )
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "2" and "busy" in response.json()["error"]
        # Other routes still answer, and the database is reachable (only its writes
        # wait): the collector is healthy, busy is not down.
        health = server.get("/healthz")
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "database": "ok", "pid": server.proc.pid}
        blocker.execute("ROLLBACK")
        for t in first:
            t.join(30)
        assert results == {0: 200, 1: 200}  # what was accepted is stored
        assert server.get("/api/v1/runs/r1").json()["ranks_seen"] == 2
        assert (
            'trainwarden_ingest_requests_total{outcome="busy"} 1.0' in server.get("/metrics").text
        )
    finally:
        stop_serve(server)
