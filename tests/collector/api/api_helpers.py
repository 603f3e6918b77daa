"""What the HTTP API's tests share: ``ingest`` posts a batch and rolls it up at once,
``telemetry_step`` is a step with every telemetry field set."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from trainwarden.collector.rollups.worker import flush

from ..helpers import step


def ingest(client: TestClient, body: dict) -> dict:
    response = client.post("/api/v1/ingest", json=body)
    assert response.status_code == 200, response.text
    flush(client.app.state.engine, now=time.time(), grace_s=0)
    return response.json()


def telemetry_step(n: int, *, rank: int, flags: list[str] | None = None) -> dict:
    return {
        **step(n, loss=2.0 + rank, duration=1.0),
        "grad_norm": 0.5 + rank,
        "fwd_s": 0.2,
        "bwd_s": 0.5,
        "opt_s": 0.2,
        "other_s": 0.1,
        "compute_s": 0.8 - 0.2 * rank,
        "exposed_comm_s": 0.2 + 0.2 * rank,
        "overlapped_comm_s": 0.3,
        "comm_source": "hook",
        "flops": 4e12,
        "mfu": 0.4,
        "peak_flops": 10e12,
        "flops_source": "given: flops_per_step",
        "peak_source": "given",
        "rss_bytes": 1 << 30,
        **({"flags": flags} if flags else {}),
    }
