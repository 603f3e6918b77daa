"""trainwarden loadgen against a real serve: every simulated rank's rows arrive."""

from __future__ import annotations

import subprocess
import sys
import time

from ..conftest import Server


def test_loadgen_rows_all_arrive_and_roll_up(live_server: Server) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainwarden.collector.cli", "loadgen", "--url", live_server.url,
         "--ranks", "64", "--ranks-per-node", "8", "--steps-per-s", "4", "--duration", "2", "--run", "lg"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "64 ranks on 8 nodes, 8 steps" in result.stdout and "0 failed" in result.stdout
    assert "25 metrics a row" in result.stdout  # 19 built-in + 6 user metrics (the default)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        series = live_server.get("/api/v1/runs/lg/series", metric="step_time").json()
        if series.get("n") == [64] * 8:
            break
        time.sleep(0.3)
    assert series["n"] == [64] * 8
    assert len(live_server.get("/api/v1/runs/lg/ranks").json()) == 64
    user = live_server.get("/api/v1/runs/lg/metrics").json()["user"]
    assert len(user) == 6 and "user.lr" in user
    lr = live_server.get("/api/v1/runs/lg/series", metric="user.lr").json()
    assert lr["n"] == [64] * 8 and lr["min"] == lr["max"]  # one schedule on every rank
