"""A real 2-rank gloo training (torchrun) instrumented by the agent, against a real
``trainwarden serve`` on loopback, on SQLite and on PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ..helpers import Server
from . import launch


def torchrun(server: Server, *args: str, nproc: int = 2) -> None:
    # --standalone: torchrun binds a free port itself (a port picked here first may be
    # taken by another test's process before torchrun binds it: EADDRINUSE, seen in CI).
    cmd = launch.torchrun(nproc, "-m", "trainwarden.agent.demo_trainer", "--url", server.url, *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINWARDEN_FLUSH_INTERVAL": "0.2"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def rolled_up(server: Server, run: str, steps: int, *, within_s: float = 15.0) -> dict:
    """The run's loss series once its rollups reach ``steps`` steps (the rollup worker
    rolls a step up a moment after its last row; a busy CI machine makes that longer),
    or as it is at the deadline."""
    deadline = time.monotonic() + within_s
    while True:
        loss = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        if len(loss["step"]) >= steps or time.monotonic() > deadline:
            return loss
        time.sleep(0.2)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_both_ranks_steps_arrive(live_server: Server) -> None:
    # --work-ms: each step also waits 20 ms as if on a device. The tiny model's compute is
    # a few ms of CPU, and on a machine whose two cores run other tests too, one rank can
    # get less CPU than the other for five steps running: a real straggler (compute 1.2x
    # its peer's), which this healthy run must not have (CI saw one).
    torchrun(live_server, "--run-name", "e2e", "--steps", "30", "--work-ms", "20")

    run = live_server.get("/api/v1/runs/e2e").json()
    assert run["world_size"] == 2 and run["ranks_seen"] == 2
    assert run["last_step"] == 29 and run["status"] == "finished"
    assert [r["rank"] for r in run["ranks"]] == [0, 1]
    assert all(r["last_step"] == 29 for r in run["ranks"])

    loss = rolled_up(live_server, "e2e", 30)
    assert loss["step"] == list(range(30))
    assert loss["n"] == [2] * 30  # every step came from both ranks
    # Each rank trains on its own samples, so their losses differ...
    assert all(lo < hi for lo, hi in zip(loss["min"], loss["max"], strict=True))
    # ...and the model learns: the loss falls from about ln(64) = 4.16.
    assert loss["median"][0] > 3.9 and loss["median"][-1] < loss["median"][0] - 0.4

    # The API returns each rank's own loss; they differ because their data does.
    own = [
        live_server.get(f"/api/v1/runs/e2e/ranks/{r}/series", metric="loss").json()["value"]
        for r in (0, 1)
    ]
    assert all(a != b for a, b in zip(*own, strict=True))
    # tw.watch in the trainer: phases, the DDP comm split, MFU on a measured CPU peak.
    for metric in (
        "exposed_comm",
        "overlapped_comm",
        "compute",
        "forward",
        "backward",
        "mfu",
        "grad_norm",
    ):
        values = live_server.get("/api/v1/runs/e2e/series", metric=metric).json()
        assert values["n"] and all(n == 2 for n in values["n"]), metric

    # The learning rate (s.lr, built in) and the trainer's own batch accuracy (s.metric).
    assert live_server.get("/api/v1/runs/e2e/metrics").json()["user"] == ["user.accuracy"]
    lr = live_server.get("/api/v1/runs/e2e/series", metric="lr").json()
    assert lr["n"] == [2] * 30 and lr["max"] == [3e-3] * 30
    accuracy = live_server.get("/api/v1/runs/e2e/heatmap", metric="user.accuracy").json()
    assert accuracy["ranks"] == [0, 1] and all(
        0 <= v <= 1 for row in accuracy["values"] for v in row
    )

    step_time = live_server.get("/api/v1/runs/e2e/series", metric="step_time").json()
    assert all(0 < v < 5 for v in step_time["max"])
    tokens = live_server.get("/api/v1/runs/e2e/series", metric="tokens").json()
    assert tokens["total"] == [2 * 64 * 8] * 30  # batch 64 x context 8 on each rank

    # A healthy run: no rank was ever judged slow, hung or dead.
    every = live_server.get("/api/v1/runs/e2e/events").json()
    verdicts = [e for e in every if e["kind"] == "rank_state"]
    bad = [
        (v["rank"], v["data"]) for v in verdicts if v["data"].get("to") in ("slow", "hung", "dead")
    ]
    assert not bad, bad
    # The agents' own events.
    events = [e for e in every if e["kind"] != "rank_state"]
    assert sorted((e["kind"], e["rank"]) for e in events) == [
        ("attempt_end", 0),
        ("attempt_end", 1),
        ("attempt_start", 0),
        ("attempt_start", 1),
        ("gpu_telemetry", 0),
        ("gpu_telemetry", 1),  # "unavailable": no GPU here
        ("shutdown", 0),
        ("shutdown", 1),
        ("start", 0),
        ("start", 1),
    ]
    # One attempt, both processes said goodbye: completed, with the trainer's config.
    attempts = live_server.get("/api/v1/runs/e2e/attempts").json()
    assert [(a["number"], a["exit_reason"]) for a in attempts] == [(1, "completed")]
    assert live_server.get("/api/v1/runs/e2e/identity").json()["config"]["steps"] == 30


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_restarted_run_continues_without_duplicates(live_server: Server) -> None:
    torchrun(live_server, "--run-name", "resumed", "--steps", "20")
    # The job restarts from a checkpoint at step 15: steps 15..19 are replayed.
    torchrun(live_server, "--run-name", "resumed", "--steps", "15", "--start-step", "15")

    assert live_server.get("/api/v1/runs/resumed").json()["last_step"] == 29  # all stored
    loss = rolled_up(live_server, "resumed", 30)
    assert loss["step"] == list(range(30))
    assert loss["n"] == [2] * 30
    restarts = live_server.get("/api/v1/runs/resumed/events", kind="restart").json()
    assert sorted(e["rank"] for e in restarts) == [0, 1]
    assert live_server.get("/api/v1/runs/resumed").json()["last_step"] == 29
