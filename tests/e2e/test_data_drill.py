"""Data-order drills on real gloo ranks: ``data=same_batch@step=20`` on 4 ranks of the
demo trainer (every rank draws rank 0's batch from step 20 on, as a sampler that ignores
the rank would) is flagged on step 20, naming every rank, and DuplicateBatchAcrossRanks
fires; before step 20 nothing is."""

from __future__ import annotations

from pathlib import Path

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
        steps=40,
        work_ms=20,
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
