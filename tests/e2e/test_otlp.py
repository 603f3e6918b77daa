"""Two real agents with ``exporter="otlp"`` against a real ``trainwarden serve`` on
loopback (SQLite and PostgreSQL): steps, events and heartbeats arrive over OTLP/HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ..helpers import Server

STEPS = 12
AGENT = """
import os, time, trainwarden.agent as tw
rank = int(os.environ["RANK"])
agent = tw.init(run="otlp-e2e", exporter="otlp", profile_every=0, flush_interval_s=0.2)
for n in range({steps}):
    with tw.step(n, tokens=100 * (rank + 1)) as s:
        time.sleep(0.03 * (rank + 1))
        s.loss(5.0 - 0.25 * n + rank)
        s.grad_norm(1.0 + n)
tw.shutdown()
# Every record taken by the collector, none dropped. A request it refused while busy (503
# with Retry-After: a CI host's writer can lag past its 1 s rule) counts in batches_failed
# and is sent again: that is the agent doing its job, not a loss.
stats = agent.stats.as_dict()
assert stats["sent"] == stats["recorded"] > 0, stats
assert not [k for k, v in stats.items() if k.startswith("dropped") and v], stats
"""


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_two_ranks_send_over_otlp(live_server: Server) -> None:
    env = {
        **os.environ,
        "TRAINWARDEN_URL": live_server.url,
        "TRAINWARDEN_EXPORTER": "otlp",
        "WORLD_SIZE": "2",
    }
    code = AGENT.format(steps=STEPS)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]

    # Rollups run in serve's worker once both ranks reported a step.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        loss = live_server.get("/api/v1/runs/otlp-e2e/series", metric="loss").json()
        if loss.get("n") == [2] * STEPS:
            break
        time.sleep(0.2)
    assert loss["step"] == list(range(STEPS)) and loss["n"] == [2] * STEPS
    assert loss["min"] == [5.0 - 0.25 * n for n in range(STEPS)]
    assert loss["max"] == [6.0 - 0.25 * n for n in range(STEPS)]

    own = live_server.get("/api/v1/runs/otlp-e2e/ranks/1/series", metric="grad_norm").json()
    assert own["value"] == [1.0 + n for n in range(STEPS)]
    tokens = live_server.get("/api/v1/runs/otlp-e2e/series", metric="tokens").json()
    assert tokens["total"] == [300] * STEPS
    step_time = live_server.get("/api/v1/runs/otlp-e2e/series", metric="step_time").json()
    # The slowest rank per step is the one whose own stored duration is largest (rank 1
    # sleeps twice as long, but a busy machine can stall rank 0 past it on a step).
    own_time = [
        live_server.get(f"/api/v1/runs/otlp-e2e/ranks/{r}/series", metric="step_time").json()[
            "value"
        ]
        for r in (0, 1)
    ]
    assert step_time["argmax_rank"] == [
        int(b >= a) for a, b in zip(*own_time, strict=True)
    ]  # ties: higher rank
    assert step_time["max"] == [max(a, b) for a, b in zip(*own_time, strict=True)]
    assert all(b >= 0.06 for b in own_time[1])  # rank 1's sleeps arrived as rank 1's
    assert all(0.06 <= v < 1.0 for v in step_time["max"])
    assert all(0.03 <= v < 0.5 for v in step_time["min"])

    # Events travel as trainwarden.event points: start and shutdown end the run cleanly.
    run = live_server.get("/api/v1/runs/otlp-e2e").json()
    assert (run["status"], run["world_size"], run["last_step"]) == ("finished", 2, STEPS - 1)
    events = live_server.get("/api/v1/runs/otlp-e2e/events").json()
    # (rank 1 is twice as slow: the collector's own rank_state events may call it slow)
    assert sorted((e["kind"], e["rank"]) for e in events if e["kind"] != "rank_state") == [
        ("attempt_end", 0),
        ("attempt_end", 1),
        ("attempt_start", 0),
        ("attempt_start", 1),
        ("gpu_telemetry", 0),
        ("gpu_telemetry", 1),
        ("shutdown", 0),
        ("shutdown", 1),
        ("start", 0),
        ("start", 1),
    ]
    # The run's identity rides in the event's data attribute (JSON) through OTLP too.
    attempts = live_server.get("/api/v1/runs/otlp-e2e/attempts").json()
    assert [(a["number"], a["exit_reason"]) for a in attempts] == [(1, "completed")]
    assert live_server.get("/api/v1/runs/otlp-e2e/identity").json()["env"]["python"]
    ranks = live_server.get("/api/v1/runs/otlp-e2e/ranks").json()
    assert [(r["rank"], r["state"], r["last_step"]) for r in ranks] == [
        (0, "finished", STEPS - 1),
        (1, "finished", STEPS - 1),
    ]
    metrics = live_server.get("/metrics").text
    assert 'trainwarden_ingest_requests_total{outcome="ok"}' in metrics
