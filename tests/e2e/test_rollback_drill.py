"""Rollback drill on real gloo ranks: a loss spike makes the collector fire LossSpike,
its ``action: rollback`` runs under an ``auto`` policy, every rank restores the same
checkpoint after the same step, skips the data window, and the run finishes with its
loss back on its earlier trend. On 2 and on 4 ranks.

Every rank restores at most 2 steps after the command reached it (the issue's target):
each answers the prepare with its step and holds at its next boundary, and the barrier is
one past the newest step answered; in lockstep the ranks' steps differ by at most one.
Prints the steps and seconds.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from ..helpers import start_serve, stop_serve, wait_for
from .helpers import STEPS, launch, rolled_back, serve_with_rollback, stop


# Two ranks on SQLite, four on PostgreSQL: each database and each world size once.
@pytest.mark.parametrize(("db_url", "world"), [("sqlite", 2), ("postgres", 4)], indirect=["db_url"])
def test_loss_spike_rolls_every_rank_back_to_the_same_checkpoint(
    db_url: str, tmp_path: Path, world: int
) -> None:
    server = serve_with_rollback(db_url, tmp_path)
    run = f"rollback{world}"
    procs = launch(server, run, world, tmp_path / "ckpt", tmp_path)
    try:
        action, barrier, logs = rolled_back(server, run, world, procs, tmp_path)
        result = action["result"]
        plan = action["plan"]["rollback"]
        assert (plan["skip_from"], plan["checkpoint_path"].endswith("step-30.pt")) == (31, True)
        for r in range(world):
            assert f"rolled back to step 30 after step {barrier}" in logs[r]
        # Goodput: the steps the rollback threw away (31 up to the barrier) count as replayed
        # work, and the rollback as an interruption.
        goodput = server.get(f"/api/v1/runs/{run}/economics").json()["goodput"]
        assert (goodput["rollbacks"], goodput["interruptions"], goodput["replayed_steps"]) == (
            1,
            1,
            barrier - 30,
        ), goodput
        assert goodput["breakdown_gpu_s"]["replayed"] > 0, goodput
        history = [h["state"] for h in action["history"]]
        assert history[:3] == ["proposed", "approved", "executing"] and history[-1] == "done"
        # The replayed steps train on other batches on purpose (the plan's skip window):
        # no data-order drift is flagged for them (the demo trainer sends its ids).
        drift = server.get(f"/api/v1/runs/{run}/events", kind="data_order_drift").json()
        assert drift == [], drift

        # The run reached its last step, and its loss is back on the trend it had.
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        loss = dict(zip(series["step"], series["median"], strict=True))
        assert max(loss) == STEPS - 1
        before = statistics.median(loss[s] for s in range(25, 35))
        spike = max(loss[s] for s in range(36, barrier + 1) if s in loss) if barrier >= 36 else None
        after = statistics.median(loss[s] for s in range(STEPS - 10, STEPS))
        assert after < 1.1 * before, (before, after)
        # The series keeps the steps run again; their first executions, the spike among
        # them, are kept as replaced: 31 up to the barrier, on every rank.
        replaced = server.get(f"/api/v1/runs/{run}/replaced", metric="loss").json()
        assert replaced["step"] == list(range(31, barrier + 1)), replaced
        assert set(replaced["n"]) == {world}, replaced
        assert max(replaced["max"]) > 1.5 * before, (before, replaced["max"])  # the 50x update
        ranks = server.get(f"/api/v1/runs/{run}/ranks").json()
        assert {r["state"] for r in ranks} == {"finished"}

        times = server.get(f"/api/v1/runs/{run}/series", metric="step_time").json()
        step_s = statistics.median(times["total"][10:30])
    finally:
        stop(procs)
        stop_serve(server)
    print(
        f"\n{world} ranks: the command reached the ranks "
        f"after step {action['plan']['answered_at_step']}; "
        f"every rank restored after step {barrier} ({result['steps_after_command']} step(s) later; "
        f"{result['since_prepare_s']:.2f} s from the prepare, "
        f"commit -> restored {result['restored_within_s']:.2f} s, "
        f"at {step_s * 1000:.0f} ms a step); loss {before:.3f} before the spike"
        + (f", {spike:.3f} at its peak" if spike else "")
        + f", {after:.3f} at the end"
    )


def fast_spike(
    tmp_path: Path, run: str, trainer_args: tuple[str, ...] = ()
) -> tuple[dict[str, Any], dict[int, str], dict[int, float], dict[str, Any]]:
    """Two ranks of ~40 ms steps, a checkpoint every 20, the default pack's LossSpike (a
    baseline rule, seen by a pass that runs every ~2 s: dozens of steps after the loss
    left its trend) and an auto rollback; the update of step 270 is spiked. Once the ranks
    have exited: the rollback (done or failed), the ranks' logs and the loss series.

    Step 270, not issue 38's 120: LossSpike compares with the median of up to 200 steps
    after a warm-up of 50; at step 120 it has 70, and a spike longer than half of them
    becomes its own baseline, so the rule holds for ~70 steps (2.5 s here), too short for
    two engine passes on a loaded machine. With a full baseline it holds for ~100."""
    actions = tmp_path / "actions.yaml"
    actions.write_text("rollback:\n  mode: auto\n")
    server = start_serve(
        "sqlite:///" + str(tmp_path / "tw.db"),
        tmp_path / "serve.log",
        env={"TRAINWARDEN_ACTIONS": str(actions)},
    )
    procs = launch(
        server,
        run,
        2,
        tmp_path / "ckpt",
        tmp_path,
        drill="loss_spike=1000x@step=270",
        steps=FAST_STEPS,
        work_ms=30,
        checkpoint_every=20,
        trainer_args=trainer_args,
    )
    try:
        codes = [p.wait(300) for p in procs]
        logs = {r: (tmp_path / f"{run}-rank{r}.log").read_text() for r in range(2)}
        assert codes == [0, 0], logs
        try:
            (action,) = wait_for(
                lambda: [
                    a
                    for a in server.get("/api/v1/actions", run=run).json()
                    if a["kind"] == "rollback" and a["state"] in ("done", "failed")
                ],
                30,
                "the rollback done",
            )
        except AssertionError as exc:  # say where it stopped (CI once saw no end, and no why)
            raise AssertionError(
                f"{exc}\nactions: {server.get('/api/v1/actions', run=run).json()}\n"
                f"alerts: {server.get('/api/v1/alerts', run=run, state='resolved').json()}"
                f"{server.get('/api/v1/alerts', run=run).json()}\nranks' logs: {logs}"
            ) from None
        (alert,) = [
            a for a in server.get("/api/v1/alerts", run=run).json() if a["rule"] == "LossSpike"
        ]
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        loss = dict(zip(series["step"], series["median"], strict=True))
    finally:
        stop(procs)
        stop_serve(server)
    return action, logs, loss, alert


FAST_STEPS = 440


def test_fast_steps_restore_a_checkpoint_saved_before_the_spiked_update(tmp_path: Path) -> None:
    """Issue 38, as a user with a small fast model runs it. The loss of step 271 is the
    first off its trend; the checkpoint of step 280 (before the fix: the newest before
    the step the engine saw it at) already holds the spiked update of step 270."""
    action, logs, loss, alert = fast_spike(tmp_path, "fast-spike")
    assert alert["onset_step"] == 271, alert
    assert action["state"] == "done", action
    plan = action["plan"]["rollback"]
    assert plan["reason"] == "rule:LossSpike: onset at step 271", action
    assert plan["checkpoint_step"] == 260, action  # 271 - 2 - margin 3; 280 holds the spike
    assert action["result"]["check"].startswith("LossSpike no longer holds on steps 261-"), action
    assert "restores" not in action["result"], action
    for r in range(2):
        assert "rolled back to step 260 after step" in logs[r]
    # The run ends with its loss back on the trend it had before the spike (40-step
    # medians: a 10-step one of this data swings by 10 %, e.g. 2.43 to 2.68).
    assert max(loss) == FAST_STEPS - 1
    before = statistics.median(loss[s] for s in range(230, 270))
    after = statistics.median(loss[s] for s in range(FAST_STEPS - 40, FAST_STEPS))
    assert after < 1.1 * before, (before, after)


def test_a_restore_that_does_not_bring_the_loss_back_rolls_back_again(tmp_path: Path) -> None:
    """The clean checkpoint of step 260 is damaged on disk: its restore replays a spiked
    loss, so the rollback goes again, to the checkpoint of step 240, and only then is done."""
    action, logs, loss, alert = fast_spike(tmp_path, "bad-ckpt", ("--corrupt-checkpoint", "260"))
    # 271; or 261 once a pass saw the replay from the damaged checkpoint, spiked from
    # step 261, in the same episode of the alert (an episode keeps its earliest onset).
    assert alert["onset_step"] in (261, 271), alert
    assert action["state"] == "done", action
    (first,) = action["result"]["restores"]
    assert first["checkpoint_step"] == 260 and first["detail"].startswith("run: loss "), action
    assert action["plan"]["rollback"]["checkpoint_step"] == 240, action
    assert action["result"]["check"].startswith("LossSpike no longer holds on steps 241-"), action
    for r in range(2):
        assert "rolled back to step 260 after step" in logs[r], logs[r]
        assert "rolled back to step 240 after step" in logs[r], logs[r]
    before = statistics.median(loss[s] for s in range(200, 240))  # 40 steps: see above
    after = statistics.median(loss[s] for s in range(FAST_STEPS - 40, FAST_STEPS))
    assert after < 1.1 * before, (before, after)
