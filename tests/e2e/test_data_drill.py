"""Data-order drills on real gloo ranks: ``data=same_batch@step=20`` on 4 ranks of the
demo trainer (every rank draws rank 0's batch from step 20 on, as a sampler that ignores
the rank would) is flagged on step 20, naming every rank, and DuplicateBatchAcrossRanks
fires; before step 20 nothing is. A restart that resumes with the sampler's position is
quiet; one that forgets it (``data=forget_sampler_state``) is DataOrderDrift, both under
torchrun's restart."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ..helpers import Server, start_serve, stop_serve, wait_for
from .helpers import launch, stop
from .launch import demo_job


def test_every_rank_on_rank_0_s_batch_is_flagged_on_the_first_step(tmp_path: Path) -> None:
    server = start_serve(f"sqlite:///{tmp_path / 'data.db'}", tmp_path / "serve.log")
    run, world = "same-batch4", 4
    procs = launch(
        server,
        run,
        world,
        tmp_path / "ckpt",
        tmp_path,
        drill="data=same_batch@step=20",
        steps=200,  # on long enough for the evaluator and the alert engine's passes
        work_ms=10,
        checkpoint_every=0,
    )
    try:
        codes = [p.wait(300) for p in procs]
        logs = {r: (tmp_path / f"{run}-rank{r}.log").read_text() for r in range(world)}
        assert codes == [0] * world, logs
        alerts = wait_for(
            lambda: [
                a
                for a in server.get("/api/v1/alerts", run=run).json()
                if a["rule"] == "DuplicateBatchAcrossRanks"
            ],
            30,
            "the alert",
        )
        events = server.get(f"/api/v1/runs/{run}/events", kind="duplicate_batch").json()
        drills = server.get(f"/api/v1/runs/{run}/events", kind="drill").json()
    finally:
        stop(procs)
        stop_serve(server)
    (event,) = events
    assert (event["step"], event["data"]["ranks"]) == (20, [0, 1, 2, 3]), event
    assert event["data"]["replica_group"] == "0-3"  # DDP's group, from the replica checks
    (alert,) = alerts
    assert alert["state"] == "firing" and "ranks 0-3" in alert["annotations"]["description"]
    assert {(d["rank"], d["step"], d["data"]["spec"]) for d in drills} == {
        (r, 20, "data=same_batch@step=20") for r in range(world)
    }


def torchrun(server: Server, run: str, ckpt: Path, log: Path, drill: str) -> int:
    """The demo trainer on 2 gloo ranks under ``torchrun --max-restarts=1``: checkpoints
    every 10 steps, ~10 ms steps; returns torchrun's exit code."""
    cmd = demo_job(
        2,
        run,
        server.url,
        "--steps",
        "300",  # on long enough after the resume for the evaluator's and alert engine's passes
        "--work-ms",
        "10",
        "--batch-size",
        "32",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "10",
        restarts=1,
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_DRILL": drill,
        "TRAINWARDEN_FLUSH_INTERVAL": "0.5",
        "TRAINWARDEN_PROFILE_EVERY": "0",
    }
    with log.open("w") as out:
        return subprocess.run(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=300
        ).returncode


@pytest.mark.parametrize("forget", [False, True], ids=["sampler-restored", "sampler-forgotten"])
def test_a_resume_that_forgets_the_sampler_is_named_at_its_first_step_as_re_fed(
    tmp_path: Path, forget: bool
) -> None:
    """Under torchrun (2 ranks, one restart allowed): ``die@rank=1,step=70`` ends the first
    attempt (the other rank fails with it); torchrun restarts both, which resume from the
    checkpoint of step 60. With the sampler's position restored (the demo trainer's data
    cursor is in its checkpoints), no data alert; with ``data=forget_sampler_state`` (the
    sampler starts again at batch 0), DataOrderDrift names step 61 and every rank, their
    batches re-fed from step 0, within 5 s of the step arriving."""
    server = start_serve(f"sqlite:///{tmp_path / 'resume.db'}", tmp_path / "serve.log")
    run = f"resume-{int(forget)}"
    drill = "die@rank=1,step=70" + ("; data=forget_sampler_state" if forget else "")
    log = tmp_path / "torchrun.log"
    try:
        code = torchrun(server, run, tmp_path / "ckpt", log, drill)
        assert code == 0, log.read_text()[-4000:]
        assert log.read_text().count("at step 61") == 2, log.read_text()[-4000:]  # both ranks
        attempts = server.get(f"/api/v1/runs/{run}/attempts").json()
        assert len(attempts) == 2, attempts
        if forget:
            drift = wait_for(
                lambda: server.get(f"/api/v1/runs/{run}/events", kind="data_order_drift").json(),
                30,
                "the drift event",
            )
            alerts = wait_for(
                lambda: [
                    a
                    for a in server.get("/api/v1/alerts", run=run).json()
                    if a["rule"] == "DataOrderDrift"
                ],
                30,
                "the alert",
            )
        else:
            # torchrun returned ~6 s (240 steps) after the resumed steps 61-70 were stored:
            # the evaluator (a pass a second) decided each of them as its digests came in.
            drift = server.get(f"/api/v1/runs/{run}/events", kind="data_order_drift").json()
            alerts = [
                a
                for a in server.get("/api/v1/alerts", run=run).json()
                if a["rule"] in ("DataOrderDrift", "DuplicateBatchAcrossRanks")
            ]
        steps = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
    finally:
        stop_serve(server)
    if not forget:
        assert drift == [] and alerts == [], (drift, alerts)
        return
    (event,) = drift
    assert (event["step"], event["data"]["ranks"]) == (61, [0, 1]), event
    assert event["data"]["refed"] == {"0": 0, "1": 0}
    assert "re-fed" in event["data"]["reason"]
    (alert,) = alerts
    assert alert["state"] == "firing"
    started = dict(zip(steps["step"], steps["ts"], strict=True))[61]
    assert event["ts"] - started <= 5, (event["ts"], started)
