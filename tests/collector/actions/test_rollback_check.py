"""The onset from the data, and a rollback that checks its own result on the steps run
again (SQLite and PostgreSQL): fast steps roll back before the spiked update, a restore
that does not fix it rolls back further, and one that never does fails and pages."""

from __future__ import annotations

from typing import Any

from trainwarden.collector.actions.records import summary
from trainwarden.collector.incidents.grouping import group
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from .helpers import AUTO_ROLLBACK, RUN, Cluster, events, rows, states

CHECKED = ("LossSpike", "ActionFailed")


def spiked_run(
    cluster: Any, *, budget: int = 3, corrupt: tuple[int, ...] = ()
) -> tuple[Cluster, dict[str, Any]]:
    """A run of fast steps (20 a second, an engine pass a second) whose update of step 120
    is spiked, under the default pack's LossSpike and an auto rollback: the seconds until
    the rollback has an outcome, and that action."""
    policy = {"rollback": {**AUTO_ROLLBACK["rollback"], "budget": {"count": budget}}}
    run = cluster(policy, rules=CHECKED, verify=True, spike_update=120, corrupt=corrupt)
    for _ in range(60):
        found = [a for a in run.second(20) if a["kind"] == "rollback"]
        if found and found[0]["state"] in ("done", "failed"):
            return run, found[0]
    raise AssertionError(f"no outcome: {found}")


def test_fast_steps_roll_back_to_a_checkpoint_saved_before_the_spiked_update(cluster: Any) -> None:
    run, done = spiked_run(cluster)
    # The pass that saw the doubled loss ran 20 steps after it began: the onset is the
    # data's (the loss of step 121, computed after the spiked update of step 120).
    (alert,) = [a for a in rows(run.engine, m.alerts) if a["rule"] == "LossSpike"]
    assert (alert["onset_step"], alert["active_since_step"]) == (121, 140)
    assert done["state"] == "done", done["history"]
    plan = done["plan"]["rollback"]
    assert plan["reason"] == "rule:LossSpike: onset at step 121"
    # Clean: saved at or before 121 - 2, less the margin of 2. The checkpoint of step 120
    # holds the spiked update (the onset the engine saw, 140, would have restored 130).
    assert (plan["checkpoint_step"], done["plan"]["onset_step"]) == (110, 121)
    assert done["result"]["check"] == "LossSpike no longer holds on steps 111-115 run again"
    assert [r.bad for r in run.ranks] == [False, False]
    assert states(done)[-3:] == ["executing", "executing", "done"]
    (checking,) = [h for h in done["history"] if "checking" in (h["detail"] or "")]
    expected = (
        "every rank restored the checkpoint of step 110; checking LossSpike on the steps run again"
    )
    assert checking["detail"] == expected
    assert summary("rollback", "done", done["result"], None).endswith(
        "; LossSpike no longer holds on steps 111-115 run again"
    )
    with write(run.engine) as conn:  # the incident engine's pass: the post-mortem's incident
        group(conn, now=run.now, cooldown_s=600.0)
    with run.api() as client:
        found = client.get(f"/api/v1/runs/{RUN}/checkpoints").json()
        entries = client.get(f"/api/v1/runs/{RUN}/timeline").json()["entries"]
        report = client.get(f"/api/v1/runs/{RUN}/postmortem", params={"format": "md"}).text
        (api_alert,) = [a for a in client.get("/api/v1/alerts").json() if a["rule"] == "LossSpike"]
    before = {c["step"]: c["good"] for c in found if c["ts"] < done["finished_at"]}
    assert [s for s, good in before.items() if not good and s <= 140] == [120, 130, 140]
    # Saved again once the rollback was done (restored and checked): the restored weights.
    after = [(c["step"], c["good"]) for c in found if c["ts"] >= done["finished_at"]]
    assert after and all(good for _, good in after), after
    assert api_alert["onset_step"] == 121
    # The timeline places the anomaly where it began, before the pass that saw it.
    (began,) = [e for e in entries if e["kind"] == "onset"]
    text = "LossSpike: its condition began at step 121 (seen at step 140)"
    assert (began["step"], began["text"]) == (121, text)
    assert text in report  # the post-mortem's timeline too
    assert events(run.engine, "action_failed") == []


def test_a_restore_that_does_not_bring_the_loss_back_rolls_back_again_to_an_older_checkpoint(
    cluster: Any,
) -> None:
    run, done = spiked_run(cluster, corrupt=(110,))  # the checkpoint of step 110 is bad on disk
    assert done["state"] == "done", done["history"]
    (first,) = done["result"]["restores"]
    assert (first["checkpoint_step"], first["steps"]) == (110, [111, 115])
    assert first["detail"].startswith("run: loss ") and "x its baseline" in first["detail"]
    assert done["plan"]["rollback"]["checkpoint_step"] == 100
    assert done["result"]["check"] == "LossSpike no longer holds on steps 101-105 run again"
    assert [[p.checkpoint_step for p in r.restored] for r in run.ranks] == [[110, 100]] * 2
    assert [r.bad for r in run.ranks] == [False, False]
    again = [h["detail"] for h in done["history"] if h["state"] == "approved"][-1]
    assert again.startswith(
        "the restore of the checkpoint of step 110 did not fix it "
        "(steps 111-115 run again): run: loss"
    )
    assert again.endswith("; rolling back to an older checkpoint")
    text = summary("rollback", "done", done["result"], None)
    assert (
        "restored the checkpoint of step 100" in text
        and "(the restore of step 110 had not fixed it)" in text
    )
    assert events(run.engine, "action_failed") == []


def test_a_rollback_whose_restores_never_bring_the_loss_back_fails_and_pages(cluster: Any) -> None:
    run, failed = spiked_run(cluster, budget=2, corrupt=tuple(range(10, 130, 10)))
    assert failed["state"] == "failed", failed["history"]
    assert [[p.checkpoint_step for p in r.restored] for r in run.ranks] == [[110, 100]] * 2
    assert failed["reason"].startswith(
        "the restore of the checkpoint of step 100 did not fix it "
        "(steps 101-105 run again): run: loss"
    )
    assert failed["reason"].endswith(
        "; retry budget spent: 2 rollbacks within 6h; stopping the run instead"
    )
    (ev,) = events(run.engine, "action_failed")
    assert ev["data"]["detail"] == failed["reason"]
    run.tick()
    paged = [a for a in run.alert() if a["rule"] == "ActionFailed"]
    assert [(a["state"], a["severity"]) for a in paged] == [("firing", "critical")]
