"""Build ingest bodies the way the agent does."""

from __future__ import annotations

from typing import Any


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
