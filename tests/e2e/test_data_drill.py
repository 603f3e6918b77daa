"""Data-order drills on real gloo ranks: ``data=same_batch@step=20`` on 4 ranks of the
demo trainer (every rank draws rank 0's batch from step 20 on, as a sampler that ignores
the rank would) is flagged on step 20, naming every rank, and DuplicateBatchAcrossRanks
fires; before step 20 nothing is. A restart that resumes with the sampler's position is
quiet; one that forgets it (``data=forget_sampler_state``) is DataOrderDrift."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ..conftest import start_serve, stop_serve
from .test_drills import stop, wait_for
from .test_rollback_drill import launch


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


@pytest.mark.parametrize("forget", [False, True], ids=["sampler-restored", "sampler-forgotten"])
def test_a_resume_that_forgets_the_sampler_is_named_at_its_first_step_as_re_fed(
    tmp_path: Path, forget: bool
) -> None:
    """Attempt 1: 2 ranks, ``die@rank=1,step=30`` (the other rank fails with it), checkpoints
    every 10. Attempt 2 resumes from the checkpoint of step 20: with the sampler's position
    restored (the demo trainer's data cursor is in its checkpoints), no data alert; with
    ``data=forget_sampler_state`` (the sampler starts again at batch 0), DataOrderDrift
    names step 21 and both ranks, their batches re-fed from step 0, within 5 s of the
    step."""
    server = start_serve(f"sqlite:///{tmp_path / 'resume.db'}", tmp_path / "serve.log")
    run, world, ckpt = f"resume-{int(forget)}", 2, tmp_path / "ckpt"
    first = tmp_path / "attempt1"
    second = tmp_path / "attempt2"
    first.mkdir()
    second.mkdir()
    try:
        procs = launch(
            server, run, world, ckpt, first, drill="die@rank=1,step=30", steps=45, work_ms=10
        )
        codes = [p.wait(120) for p in procs]
        assert codes[1] == 75, codes  # the drill's exit; rank 0 fails on the lost peer
        procs = launch(
            server,
            run,
            world,
            ckpt,
            second,
            drill="data=forget_sampler_state@step=0" if forget else "",
            steps=250,  # on long enough for the evaluator and the alert engine's passes
            work_ms=10,
        )
        codes = [p.wait(120) for p in procs]
        logs = {r: (second / f"{run}-rank{r}.log").read_text() for r in range(world)}
        assert codes == [0] * world, logs
        assert all("at step 21" in log for log in logs.values()), logs
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
            time.sleep(3)  # the evaluator's passes over the replayed steps (every second)
            drift = server.get(f"/api/v1/runs/{run}/events", kind="data_order_drift").json()
            alerts = []
        steps = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
    finally:
        stop(procs)
        stop_serve(server)
    if not forget:
        assert drift == [], drift
        return
    (event,) = drift
    assert (event["step"], event["data"]["ranks"]) == (21, [0, 1]), event
    assert event["data"]["refed"] == {"0": 0, "1": 0}
    assert "re-fed" in event["data"]["reason"]
    (alert,) = alerts
    assert alert["state"] == "firing"
    started = dict(zip(steps["step"], steps["ts"], strict=True))[21]
    assert event["ts"] - started <= 5, (event["ts"], started)
