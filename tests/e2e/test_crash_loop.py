"""Issue 56's crash loop, as a user runs it: ``torchrun --max-restarts 4`` with 2 ranks of
the demo trainer, rank 1 dying at the same step in every attempt. After the third attempt
CrashLoop fires naming rank 1, its node and how it ended; the action policy's ``stop``
(auto here) stops the fourth attempt; torchrun, a restart left, starts a fifth, which
is stopped too; and the run's timeline says so."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ..helpers import Server, start_serve, stop_serve, wait_for
from ..net import free_port
from .launch import demo_job

DIE_AT = 20
RULES = """\
rules:
  - name: CrashLoop
    kind: event
    summary: The job restarts and fails the same way every time.
    params: {match: event, events: [crash_loop]}
    keep_firing_for: 30m
    severity: critical
    runbook: CrashLoop.md
    action: stop
"""
ACTIONS = "stop:\n  mode: auto\n"


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    (tmp_path / "rules.yaml").write_text(RULES)
    (tmp_path / "actions.yaml").write_text(ACTIONS)
    s = start_serve(
        f"sqlite:///{tmp_path / 'tw.db'}",
        tmp_path / "serve.log",
        env={
            "TRAINWARDEN_RULES": str(tmp_path / "rules.yaml"),
            "TRAINWARDEN_DEFAULT_RULES": "0",
            "TRAINWARDEN_ACTIONS": str(tmp_path / "actions.yaml"),
        },
    )
    yield s
    stop_serve(s)


def test_a_rank_that_dies_at_the_same_step_every_attempt_is_a_crash_loop_and_is_stopped(
    server: Server, tmp_path: Path
) -> None:
    run = f"loop-{free_port()}"
    cmd = demo_job(
        2,
        run,
        server.url,
        "--steps",
        "60",
        "--work-ms",
        "400",  # the fourth attempt lives long enough for the stop to reach it
        restarts=4,
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_PROFILE_EVERY": "0",
        "TRAINWARDEN_FLUSH_INTERVAL": "0.5",
        "TRAINWARDEN_DRILL": f"die@rank=1,step={DIE_AT},attempts=all",
    }
    log = tmp_path / "torchrun.log"
    done = subprocess.run(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, timeout=300)
    said = log.read_text()
    assert done.returncode != 0, said[-3000:]  # torchrun's restarts spent: the job failed

    def fired() -> list[dict]:  # type: ignore[type-arg]
        # resolved too: its stop done, it resolves once the next attempt begins
        states = ["pending", "firing", "resolved"]
        alerts = server.get("/api/v1/alerts", run=run, state=states).json()
        return [a for a in alerts if a["rule"] == "CrashLoop"]

    wait_for(lambda: fired(), 30, "CrashLoop")
    (alert,) = fired()
    assert alert["rank"] is None, alert  # the run's: its stop ends every rank
    description = alert["annotations"]["description"]
    assert "attempts 1-3 each failed" in description, description
    assert "each time rank 1 on node " in description and "killed (no goodbye)" in description

    (event,) = server.get(f"/api/v1/runs/{run}/events", kind="crash_loop").json()
    assert (event["data"]["attempts"], event["data"]["ranks"]) == ([1, 2, 3], [1])
    assert all(DIE_AT - 6 <= s <= DIE_AT + 2 for s in event["data"]["steps"]), event

    # The stop reached the fourth attempt: both ranks stopped after the same step, with
    # trainwarden's exit status, before rank 1 could die again.
    # ... and the fifth, which torchrun started after it: the stop stands.
    actions = server.get("/api/v1/actions", run=run).json()
    stops = sorted((a for a in actions if a["kind"] == "stop"), key=lambda a: a["id"])
    assert [(a["trigger"], a["state"], a["rank"]) for a in stops] == [
        ("rule:CrashLoop", "done", None),
        ("restart after stop", "done", None),
    ], stops
    assert "(exitcode: 76)" in said, said[-3000:]
    attempts = server.get(f"/api/v1/runs/{run}/attempts").json()
    assert [a["number"] for a in attempts] == [1, 2, 3, 4, 5]
    for attempt in attempts[3:]:  # trainwarden's stop ended both (a rank of the fourth
        # that was not in yet when it came may then fail in the collective its peer left)
        ends = [p["end_reason"] for p in attempt["processes"]]
        assert "stopped" in ends, attempt

    entries = server.get(f"/api/v1/runs/{run}/timeline").json()["entries"]
    text = "\n".join(str(e) for e in entries)
    assert "CrashLoop" in text and "stop" in text, text[-3000:]
