"""The rollback's retry budget (SQLite and PostgreSQL): past it the rollback fails and
the run is stopped instead, and rollbacks that fail at the ranks spend it too."""

from __future__ import annotations

from typing import Any

from trainwarden.agent.commands import STOPPED_EXIT_CODE

from .helpers import AUTO_ROLLBACK, action, calm, commands, events, settle


def test_past_the_budget_the_rollback_fails_and_the_run_is_stopped(cluster: Any) -> None:
    run = cluster({"rollback": {**AUTO_ROLLBACK["rollback"], "budget": {"count": 1, "per": "30m"}}})
    run.spike(at=35)
    (first,) = run.act()
    assert settle(run, first["id"])["state"] == "done"
    calm(run, minutes=35)  # past the budget's period: the next rollback is allowed
    run.spike(at=50)
    second = run.act()[-1]
    assert (second["id"], second["state"], second["plan"]["rollback"]["checkpoint_step"]) == (
        first["id"] + 1,
        "executing",
        40,
    )
    assert settle(run, second["id"])["state"] == "done"
    calm(run, minutes=11)
    run.spike(at=65)
    third, stop = run.act()[-2:]
    assert third["state"] == "failed"
    assert third["reason"] == "retry budget spent: 1 rollbacks within 30m; stopping the run instead"
    assert commands(run, third["id"]) == []
    assert [e["data"]["action"] for e in events(run.engine, "action_failed")] == [third["id"]]
    assert (stop["kind"], stop["state"], stop["mode"], stop["trigger"], stop["approver"]) == (
        "stop",
        "approved",
        "auto",
        "budget",
        "policy",
    )
    (stop,) = [a for a in run.act() if a["kind"] == "stop"]
    assert stop["state"] == "executing" and stop["plan"]["ranks"] == [0, 1]
    # Rank 1 crashes before it hears of the stop; rank 0 answers the prepare and holds,
    # and, rank 1 being gone, is told to stop after the step it holds at.
    run.ranks[1].event(
        "shutdown", error="CUDA error: an illegal memory access", severity="critical"
    )
    run.ranks[1].exit_code = 1
    run.tick()
    sent = run.exchange()
    assert [(c["type"], c["phase"]) for c in sent[0]] == [("stop", "prepare")]
    assert sent[0][0]["reason"] == "trainwarden: budget (rollback budget spent)"
    (row,) = [a for a in run.act() if a["kind"] == "stop"]
    assert row["state"] == "executing"  # rank 0 has not answered yet
    (row,) = [a for a in run.second() if a["kind"] == "stop"]
    held = run.ranks[0].last_step
    assert row["plan"]["barrier_step"] == held and run.ranks[0].exit_code is None
    run.exchange([0])  # the commit
    run.second()
    assert [r.exit_code for r in run.ranks] == [STOPPED_EXIT_CODE, 1]
    assert run.ranks[0].last_step == held
    assert run.ranks[0].acks[-1] | {"phase": "stop", "stopped": True} == run.ranks[0].acks[-1]
    stop = action(run, stop["id"])
    assert (stop["state"], stop["result"]) == (
        "done",
        {
            "stopped": [0],
            "already_gone": [1],
            "no_answer": [],
            "barrier_step": held,
            "stopped_after": {"0": held},
        },
    )


def test_rollbacks_that_fail_at_the_ranks_spend_the_budget_too(cluster: Any) -> None:
    """A rollback that reaches the ranks and fails there (a handler that cannot read the
    checkpoint) is an attempt: past the budget the run is stopped, not rolled back forever."""
    run = cluster(
        {"rollback": {**AUTO_ROLLBACK["rollback"], "budget": {"count": 2, "per": "1h"}}},
        handlers={1: "raise"},
    )
    failed = []
    for at in (35, 50):
        run.spike(at=at)
        rollback = run.act()[-1]
        failed.append(settle(run, rollback["id"]))
        calm(run, minutes=11)
    assert [f["state"] for f in failed] == ["failed", "failed"]
    assert all(f["reason"].startswith("rollback not applied: rank 1: RuntimeError") for f in failed)
    run.spike(at=65)
    third, stop = run.act()[-2:]
    assert third["reason"] == "retry budget spent: 2 rollbacks within 1h; stopping the run instead"
    assert (stop["kind"], stop["trigger"]) == ("stop", "budget")
