"""The two-phase rollback on a real database (SQLite and PostgreSQL), with a controlled
clock: every rank restores after the same step, the checkpoints it may restore, and its
failures (no good checkpoint, a rank that does not answer, stops holding, has no handler
or one that raises, ends before it holds or restores)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import update

from trainwarden.collector.actions.rollback_transitions import (
    BACK_TIMEOUT_S,
    ENDED_BEFORE_HOLDING,
    ENDED_BEFORE_RESTORING,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from .helpers import AUTO_ROLLBACK, RUN, calm, commands, events, rows, settle, states


def test_rollback_restores_every_rank_after_the_same_step(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.train(34)
    run.ranks[0].event("checkpoint", step=34, path="/ckpt/step-34.pt")  # within the margin
    alerts = run.spike(at=35)
    run.tick()
    run.ranks[0].event("checkpoint", step=32, path="/ckpt/step-32.pt")  # saved after the onset
    run.exchange([0])
    (rollback,) = run.act()  # one rollback for the alerts of both ranks
    assert (rollback["state"], rollback["mode"], rollback["approver"]) == (
        "executing",
        "auto",
        "policy",
    )
    assert rollback["alert_id"] == alerts[0]["id"] and rollback["trigger"] == "rule:NonFiniteLoss"
    plan = rollback["plan"]
    assert plan["rollback"] == {
        "checkpoint_step": 30,
        "checkpoint_path": "/ckpt/step-30.pt",
        "skip_from": 31,
        "skip_to": 35 + 5,
        "lr_scale": None,
        "reason": "rule:NonFiniteLoss: onset at step 35",
    }
    assert (plan["issued_at_step"], plan["ranks"], plan["attempt"]) == (35, [0, 1], 1)
    assert "barrier_step" not in plan

    run.tick()
    sent = run.exchange()  # each rank answers at once, with the last step it finished ...
    for r in (0, 1):
        (prepare,) = sent[r]
        assert prepare == {
            "id": prepare["id"],
            "type": "rollback",
            "phase": "prepare",
            "action": rollback["id"],
            "attempt": 1,
            "plan": plan["rollback"],
        }
    assert {c["delivered_at"] for c in commands(run, rollback["id"])} == {run.now}
    assert [r.events[-1]["step"] for r in run.ranks] == [35, 35]
    assert [r.acks[-1] for r in run.ranks] == [
        {"command": sent[r][0]["id"], "action": rollback["id"], "phase": "prepare", "armed": True}
        for r in (0, 1)
    ]
    run.train(45)  # ... and holds at its next step boundary
    assert [r.last_step for r in run.ranks] == [36, 36]
    run.exchange()
    (rollback,) = run.act()  # every rank answered: the collector commits, barrier 35 + 1
    plan = rollback["plan"]
    assert rollback["state"] == "executing" and plan["committed_at"] == run.now
    assert (plan["barrier_step"], plan["answered_at_step"], plan["rollback"]["skip_to"]) == (
        36,
        35,
        36 + 5,
    )
    run.tick()
    commits = run.exchange()  # the prepare too: a command is sent until its action is over
    assert [[c["phase"] for c in commits[r]] for r in (0, 1)] == [["prepare", "commit"]] * 2
    assert commits[0][1] | {"barrier_step": 36, "skip_to": 41, "attempt": 1} == commits[0][1]
    run.train(45)  # both restore where they hold, after step 36
    assert [(r.last_step, [p.checkpoint_step for p in r.restored]) for r in run.ranks] == [
        (36, [30])
    ] * 2
    assert [r.restored[0].barrier_step for r in run.ranks] == [36, 36]
    run.exchange()
    (done,) = run.act()
    assert done["state"] == "done" and done["finished_at"] == run.now
    per_rank = done["result"]["ranks"]
    assert {r: (a["barrier_step"], a["checkpoint_step"], a["at"]) for r, a in per_rank.items()} == {
        "0": (36, 30, run.now),
        "1": (36, 30, run.now),
    }
    assert all(0 <= a["seconds"] < 1 for a in per_rank.values())  # how long the handler took
    result = done["result"]
    assert (
        result["restored_within_s"],
        result["steps_after_command"],
        result["steps_after_issue"],
    ) == (1.0, 1, 1)
    assert {c["done_at"] for c in commands(run, done["id"])} == {run.now}
    assert run.exchange() == {0: [], 1: []}  # nothing left to send
    assert states(done) == ["proposed", "approved", "executing", "executing", "done"]

    # The ranks go on from step 31, skipping the data window; the alerts do not act again.
    run.train(50)
    assert [b for b in range(29, 46) if run.ranks[0].commands.should_skip_batch(b)] == list(
        range(31, 42)
    )
    for _ in range(3):
        assert [a["state"] for a in run.second()] == ["done"]
    timeline = [(e["data"]["state"], e["data"].get("detail")) for e in events(run.engine, "action")]
    assert timeline == [
        ("approved", None),
        ("executing", "prepare: every rank holds at its next step (attempt 1)"),
        ("executing", "commit: every rank holds; restore after step 36"),
        ("done", None),
    ]
    assert events(run.engine, "action_failed") == []


def test_an_operator_rollback_while_another_executes_fails_instead_of_racing_it(
    cluster: Any,
) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    (rule,) = run.act()
    assert rule["state"] == "executing"
    with run.api() as client:
        made = client.post(
            f"/api/v1/runs/{RUN}/actions",
            json={"kind": "rollback", "by": "ana", "reason": "bad shard", "checkpoint_step": 20},
        )
        assert made.status_code == 201, made.text
    rule, operator = run.act()
    assert (rule["state"], operator["state"]) == ("executing", "failed")
    assert (
        operator["reason"]
        == f"rollback {rule['id']} of this run is executing; not starting a second one"
    )
    assert commands(run, operator["id"]) == []
    assert settle(run, rule["id"])["state"] == "done"


def test_checkpoints_are_listed_good_or_suspect(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)  # margin_steps 2
    run.train(34)
    run.ranks[0].event(
        "checkpoint", step=34, path="/ckpt/step-34.pt", bytes=123
    )  # within the margin
    run.spike(at=35)
    run.ranks[0].event("checkpoint", step=32, path="/ckpt/step-32.pt")  # saved after the onset
    run.exchange([0])
    with run.api() as client:
        listed = client.get(f"/api/v1/runs/{RUN}/checkpoints").json()
        assert client.get("/api/v1/runs/nope/checkpoints").status_code == 404
    (alert_id,) = {a["id"] for a in rows(run.engine, m.alerts) if a["rank"] == 0}
    why = f"saved before NonFiniteLoss (alert {alert_id}, onset at step 35) cleared"
    assert [(c["step"], c["good"], c["suspect"]) for c in listed] == [
        (10, True, None),
        (20, True, None),
        (30, True, None),
        (34, False, why),
        (32, False, why),
    ]
    assert listed[3] | {"path": "/ckpt/step-34.pt", "rank": 0, "meta": {"bytes": 123}} == listed[3]
    (rollback,) = run.act()  # it restores the newest good one
    assert rollback["plan"]["rollback"]["checkpoint_step"] == 30
    assert settle(run, rollback["id"])["state"] == "done"
    calm(run, minutes=11)  # the anomaly clears: what is saved from now on is good
    run.ranks[0].event("checkpoint", step=60, path="/ckpt/step-60.pt")
    run.exchange([0])
    with run.api() as client:
        listed = client.get(f"/api/v1/runs/{RUN}/checkpoints").json()
    assert (listed[-1]["step"], listed[-1]["good"]) == (60, True), listed


def test_a_rollback_without_a_good_checkpoint_fails_and_pages(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike(at=11)  # the only checkpoint, step 10, is within the margin of the onset
    (failed,) = run.act()
    assert failed["state"] == "failed" and failed["finished_at"] == run.now
    why = "no checkpoint at or before step 7 (onset 11 - 2 - margin 2); reported: [10]"
    assert failed["reason"] == why
    assert states(failed) == ["proposed", "approved", "failed"]
    assert commands(run, failed["id"]) == []
    (ev,) = events(run.engine, "action_failed")
    assert (ev["severity"], ev["data"]["action"], ev["data"]["detail"]) == (
        "critical",
        failed["id"],
        failed["reason"],
    )
    run.tick()
    paged = [a for a in run.alert() if a["rule"] == "ActionFailed"]
    assert [(a["state"], a["severity"]) for a in paged] == [("firing", "critical")]
    assert "action_failed" in paged[0]["annotations"]["description"]


def test_ranks_that_hear_of_it_at_different_steps_restore_after_the_same_step(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    (rollback,) = run.act()
    run.tick()
    run.exchange([0])  # rank 0 hears of it after step 35 and holds after 36 ...
    run.train(37)  # ... while rank 1, whose answers are late, trains on to 37
    assert [r.last_step for r in run.ranks] == [36, 37]
    run.exchange()  # rank 1 answers with 37 and holds after 38
    run.train(40)
    assert [r.last_step for r in run.ranks] == [36, 38]
    run.exchange()
    (rollback,) = run.act()
    assert (rollback["plan"]["barrier_step"], rollback["plan"]["answered_at_step"]) == (38, 35)
    run.tick()
    run.exchange()
    run.train(45)  # rank 0 trains on from 36 to the barrier; both restore after step 38
    assert [
        (r.last_step, [(p.barrier_step, p.checkpoint_step) for p in r.restored]) for r in run.ranks
    ] == [
        (38, [(38, 30)]),
        (38, [(38, 30)]),
    ]
    run.exchange()
    (done,) = run.act()
    assert done["state"] == "done" and done["result"]["steps_after_command"] == 3
    assert {a["barrier_step"] for a in done["result"]["ranks"].values()} == {38}


def test_a_rank_that_never_answers_fails_the_rollback_after_its_attempts(cluster: Any) -> None:
    run = cluster(
        {"rollback": {**AUTO_ROLLBACK["rollback"], "attempts": 2, "prepare_timeout": "5s"}}
    )
    run.spike()
    (rollback,) = run.act()
    run.ranks[1].silent = True
    details = []
    for _ in range(20):
        (rollback,) = run.second()
        details = [h["detail"] for h in rollback["history"]]
        if rollback["state"] == "failed":
            break
    assert rollback["state"] == "failed" and rollback["plan"]["attempt"] == 2
    assert rollback["reason"] == "ranks not ready: ranks [1] did not answer within 5s"
    assert [d for d in details if d and d.startswith(("prepare", "aborted"))] == [
        "prepare: every rank holds at its next step (attempt 1)",
        "aborted attempt 1: ranks [1] did not answer within 5s",
        "prepare: every rank holds at its next step (attempt 2)",
    ]
    assert not any(r.restored for r in run.ranks)
    held = run.ranks[0].last_step
    run.second()
    run.second()
    assert run.ranks[0].last_step == held + 1  # it heard the abort and trains on
    assert (
        run.ranks[0].acks[-1] | {"phase": "abort", "applied": False, "decision": "abort"}
        == run.ranks[0].acks[-1]
    )


def test_a_rank_that_stops_holding_aborts_the_attempt_and_the_other_hears_abort(
    cluster: Any,
) -> None:
    run = cluster({"rollback": {**AUTO_ROLLBACK["rollback"], "attempts": 1}})
    run.spike()
    (rollback,) = run.act()
    run.exchange([0])  # rank 1 does not hear of it yet
    run.train(37)
    run.ranks[0].give_up()  # rank 0's wait times out: it trains on without a decision
    assert (
        run.ranks[0].acks[-1]
        | {"phase": "timeout", "applied": False, "decision": "timeout", "barrier_step": 36}
        == run.ranks[0].acks[-1]
    )
    run.exchange()
    run.train(38)  # rank 1 holds after 38
    run.exchange()
    (failed,) = run.act()
    assert failed["state"] == "failed"
    assert (
        failed["reason"] == "ranks not ready: rank 0: stopped holding: no decision within its wait"
    )
    assert len(events(run.engine, "action_failed")) == 1
    # Rank 1 learns of the abort and trains on without waiting out its timeout.
    run.tick()
    run.exchange()
    run.train(45)
    assert [(r.last_step, r.restored) for r in run.ranks] == [(45, []), (45, [])]
    assert (
        run.ranks[1].acks[-1]
        | {"phase": "abort", "applied": False, "decision": "abort", "barrier_step": 38}
        == run.ranks[1].acks[-1]
    )
    run.tick(60)
    run.act()
    assert all(c["done_at"] is not None for c in commands(run, rollback["id"]))
    assert run.exchange() == {0: [], 1: []}


def test_a_rank_without_a_rollback_handler_fails_the_rollback_at_once(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK, handlers={1: None})
    run.spike()
    (rollback,) = run.act()
    done = settle(run, rollback["id"])
    assert done["state"] == "failed" and done["plan"]["attempt"] == 1  # no retry: it cannot work
    assert done["reason"] == "ranks not ready: rank 1: no tw.on_rollback(handler) in this trainer"
    assert not any(r.restored for r in run.ranks)


def test_a_handler_that_raises_fails_the_rollback_naming_the_rank(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK, handlers={1: "raise"})
    run.spike()
    (rollback,) = run.act()
    done = settle(run, rollback["id"])
    assert done["state"] == "failed"
    assert (
        done["reason"] == "rollback not applied: rank 1: RuntimeError: cannot read /ckpt/step-30.pt"
    )
    assert [len(r.restored) for r in run.ranks] == [1, 0]
    (ev,) = events(run.engine, "action_failed")
    assert ev["data"]["detail"] == done["reason"]


def test_a_rank_that_does_not_answer_the_prepare_times_it_out(cluster: Any) -> None:
    run = cluster(
        {"rollback": {**AUTO_ROLLBACK["rollback"], "attempts": 1, "prepare_timeout": "20s"}}
    )
    run.spike()
    (rollback,) = run.act()
    run.ranks[1].silent = True
    for _ in range(20):
        (row,) = run.second()
        assert row["state"] == "executing"
    assert run.ranks[0].last_step == 37  # it answered after step 36 and holds after 37 ...
    (failed,) = run.second()
    assert (failed["state"], failed["finished_at"]) == (
        "failed",
        rollback["plan"]["prepared_at"] + 21,
    )
    assert failed["reason"] == "ranks not ready: ranks [1] did not answer within 20s"
    run.second()
    run.second()
    assert run.ranks[0].last_step == 38  # ... and went on when it heard the abort
    assert run.ranks[0].acks[-1]["decision"] == "abort"


def test_a_rank_that_ends_before_it_holds_fails_the_rollback_at_once(cluster: Any) -> None:
    """The job finished (or a rank died) while the rollback was on its way: it fails at
    the next pass naming the rank, not after the prepare's timeout and its retries (45 s by
    default, CI's fast-step drill ended its wait first), and the others hear the abort."""
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    (rollback,) = run.act()
    ended = run.ranks[1]
    ended.event("shutdown", reason="finished")
    ended.exit_code = 0
    run.tick()
    run.exchange()  # rank 0 hears the prepare and answers; rank 1 says goodbye
    (failed,) = run.act()
    assert (failed["state"], failed["plan"]["attempt"]) == ("failed", 1)
    assert failed["reason"] == f"ranks not ready: rank 1: {ENDED_BEFORE_HOLDING}"
    run.train(40)
    run.exchange()
    run.train(40)
    assert run.ranks[0].last_step == 40  # it heard the abort and trains on
    assert run.ranks[0].acks[-1]["decision"] == "abort"


def test_a_rank_that_ends_before_it_restores_fails_the_rollback_at_once(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    (rollback,) = run.act()
    run.tick()
    run.exchange()
    run.train(45)  # both hold after step 36
    run.exchange()
    (committed,) = run.act()
    assert "committed_at" in committed["plan"]
    run.ranks[1].silent = True  # killed while holding; the health check calls it dead
    with write(run.engine) as conn:
        conn.execute(
            update(m.ranks).where(m.ranks.c.rank == 1).values(state="dead", state_since=run.now)
        )
    run.tick()
    run.exchange()
    run.train(45)  # rank 0 restores
    run.exchange()
    (failed,) = run.act()
    assert failed["state"] == "failed"
    assert failed["reason"] == f"rollback not applied: rank 1: {ENDED_BEFORE_RESTORING}"


def test_a_rollback_waits_for_every_rank_of_the_job_to_be_live(cluster: Any) -> None:
    # Rank 1 is dead when the rollback would start (a restart under way, its new process
    # not yet back): restoring rank 0 alone would leave the ranks' collectives out of
    # step. The rollback waits, then goes with both; without rank 1, it fails in time.
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    with write(run.engine) as conn:
        conn.execute(
            update(m.ranks).where(m.ranks.c.rank == 1).values(state="dead", state_since=run.now)
        )
    (waiting,) = run.act()
    assert waiting["state"] == "approved" and commands(run, waiting["id"]) == []
    assert waiting["history"][-1]["detail"] == (
        "waiting for ranks [1] to be live: every rank restores at the same step"
    )
    run.tick()
    assert len(run.act()[0]["history"]) == len(waiting["history"])  # said once
    with write(run.engine) as conn:  # back (the health pass: heard from again)
        conn.execute(update(m.ranks).where(m.ranks.c.rank == 1).values(state="healthy"))
    run.tick()
    (going,) = run.act()
    assert going["state"] == "executing" and going["plan"]["ranks"] == [0, 1], going["history"]
    assert settle(run, going["id"])["state"] == "done"


def test_a_rollback_fails_when_a_rank_does_not_come_back(cluster: Any) -> None:
    run = cluster(AUTO_ROLLBACK)
    run.spike()
    with write(run.engine) as conn:
        conn.execute(update(m.ranks).where(m.ranks.c.rank == 1).values(state="dead"))
    (waiting,) = run.act()
    assert waiting["state"] == "approved"
    run.tick(BACK_TIMEOUT_S - 1)
    assert run.act()[0]["state"] == "approved"
    run.tick(2)
    (failed,) = run.act()
    assert failed["state"] == "failed" and failed["reason"].startswith(
        "ranks [1] of 2 were not live for 900 s: a rollback restores every rank at the same step"
    ), failed
