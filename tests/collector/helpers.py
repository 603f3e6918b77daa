"""Build ingest bodies the way the agent does; send them and read a run's series back."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient

from trainwarden.collector.rollups.worker import flush


def batch(
    run: str = "r1",
    *,
    rank: int = 0,
    world_size: int = 2,
    session: str | None = None,
    steps: list[dict[str, Any]] | None = None,
    events: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "run": run,
        "agent": {
            "rank": rank,
            "world_size": world_size,
            "local_rank": rank,
            "host": f"host{rank}",
            "node": f"node{rank}",
            "pid": 1000 + rank,
            "session": session or f"session-{rank}",
            "started_at": 1_700_000_000.0,
        },
        "steps": steps or [],
        "events": events or [],
    }


def step(
    n: int, *, loss: Any = 1.0, duration: float = 0.1, tokens: int | None = 100, wait: float = 0.01
) -> dict[str, Any]:
    return {
        "step": n,
        "ts": 1_700_000_000.0 + n,
        "duration_s": duration,
        "data_wait_s": wait,
        "tokens": tokens,
        "loss": loss,
    }


def ingest_rolled_up(
    client: TestClient, body: dict[str, Any], path: str = "/api/v1/ingest"
) -> None:
    """POST ``body`` (a 200 expected), then roll up every step it queued."""
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    flush(client.app.state.engine, now=time.time(), grace_s=0)  # type: ignore[attr-defined]


def run_series(client: TestClient, metric: str, **params: Any) -> dict[str, Any]:
    """Run ``r1``'s series of ``metric`` from the API (a 200 expected)."""
    response = client.get("/api/v1/runs/r1/series", params={"metric": metric, **params})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]
