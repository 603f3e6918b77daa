"""A restart that resumed from a suspect checkpoint (``collector/actions/resumes.py``), on
a real database (SQLite and PostgreSQL) with a controlled clock: the checkpoint a
rollback undid, loaded again by a restart before the trainer saved over it, is found from
the restart's first step; ResumedFromSuspectCheckpoint fires and rolls back to the newest
good checkpoint. A restart from a good checkpoint says nothing."""

from __future__ import annotations

from typing import Any

from trainwarden.collector.store import models as m

from .helpers import AUTO_ROLLBACK, T0, Cluster, Rank, action, events, rows, settle

RULES = ("NonFiniteLoss", "ResumedFromSuspectCheckpoint", "ActionFailed")


def rolled_back(cluster: Any, until: int = 40) -> Cluster:
    """NaN at step 35 on both ranks, checkpoints of steps 40 to ``until`` saved while it
    is active (suspect), the rollback to step 30 done; the ranks run the undone steps
    again up to 33 (the checkpoints on disk past 30 are still the suspect ones)."""
    run = cluster(AUTO_ROLLBACK, rules=RULES)
    for r in run.ranks:
        r.event("attempt_start")
    run.spike(at=35)
    run.train(until)  # rank 0 saves its checkpoints while NonFiniteLoss fires
    run.exchange()
    (rollback,) = run.act()
    done = settle(run, rollback["id"])
    assert done["state"] == "done", done["history"]
    assert [r.restored[-1].checkpoint_step for r in run.ranks] == [30, 30]
    run.train(33)
    run.exchange()
    return run


def restart(run: Cluster, *, resume_after: int) -> None:
    """The job dies and its launcher restarts it: new processes, a new attempt, resumed
    from the checkpoint of step ``resume_after`` (the trainer's newest by step)."""
    for _ in range(7):  # the old processes' silence (not taken for a second live process)
        run.tick()
        run.act()
    run.ranks = [Rank(run, r, f"node{r}", "restore") for r in (0, 1)]
    for r in run.ranks:
        r.process = {"session": f"at-{run.now}-{r.rank}", "started_at": run.now}
        r.next_step = resume_after + 1
        r._n = int(run.now - T0) * 1000  # its events' ids must not repeat an earlier process's
        r.event("attempt_start")


def test_a_restart_from_the_checkpoint_a_rollback_undid_rolls_back_again(cluster: Any) -> None:
    run = rolled_back(cluster)
    restart(run, resume_after=40)
    run.second(2)  # the first steps, 41 and 42: the actions pass sees what they resumed from
    (said,) = events(run.engine, "resumed_suspect_checkpoint")
    assert (said["step"], said["rank"], said["severity"]) == (41, None, "critical")
    assert said["data"] | {"suspect": said["data"]["suspect"]} == {
        "attempt": 2,
        "checkpoint_step": 40,
        "path": "/ckpt/step-40.pt",
        "suspect": said["data"]["suspect"],
        "good_step": 30,
        "good_path": "/ckpt/step-30.pt",
        "reason": said["data"]["reason"],
    }
    assert said["data"]["suspect"].startswith("saved before NonFiniteLoss (alert ")
    assert said["data"]["reason"].startswith(
        "attempt 2 resumed at step 41 from the checkpoint of step 40 (/ckpt/step-40.pt), "
        "which is suspect: saved before NonFiniteLoss"
    ) and said["data"]["reason"].endswith("the newest good one is of step 30")
    fired = [a for a in run.alert() if a["rule"] == "ResumedFromSuspectCheckpoint"]
    assert [(a["state"], a["step"], a["action"]) for a in fired] == [("firing", 41, "rollback")]
    assert "resumed at step 41" in fired[0]["annotations"]["description"]
    again = [a for a in run.act() if a["trigger"] == "rule:ResumedFromSuspectCheckpoint"]
    assert [a["plan"]["rollback"]["checkpoint_step"] for a in again] == [30], again
    done = settle(run, again[0]["id"])
    assert done["state"] == "done", done["history"]
    assert [[p.checkpoint_step for p in r.restored] for r in run.ranks] == [[30], [30]]
    # Said once per attempt, however many passes look.
    for _ in range(3):
        run.second()
    assert len(events(run.engine, "resumed_suspect_checkpoint")) == 1


def test_the_rollback_after_a_late_resume_skips_every_suspect_checkpoint(cluster: Any) -> None:
    # Resumed from the checkpoint of step 60: its rollback's own clean limit (61 - 2 -
    # margin 2 = 57) would admit 40 and 50, which NonFiniteLoss at 35 made suspect.
    run = rolled_back(cluster, until=60)
    restart(run, resume_after=60)
    run.second(2)
    (said,) = events(run.engine, "resumed_suspect_checkpoint")
    assert (said["data"]["checkpoint_step"], said["data"]["good_step"]) == (60, 30)
    run.alert()
    again = [a for a in run.act() if a["trigger"] == "rule:ResumedFromSuspectCheckpoint"]
    assert [a["plan"]["rollback"]["checkpoint_step"] for a in again] == [30], again


def test_a_restart_from_a_good_checkpoint_says_nothing(cluster: Any) -> None:
    run = rolled_back(cluster)
    # The steps run again reach 40: the checkpoint of step 40 is saved over while
    # NonFiniteLoss still fires, after the rollback was done: the restored weights, good.
    run.train(40)
    run.exchange()
    assert {a["state"] for a in rows(run.engine, m.alerts) if a["rule"] == "NonFiniteLoss"} == {
        "firing"
    }
    restart(run, resume_after=40)
    for _ in range(3):
        run.second(2)
    restart(run, resume_after=30)  # the checkpoint the rollback restored: good
    for _ in range(3):
        run.second(2)
    assert [a["number"] for a in rows(run.engine, m.attempts)] == [1, 2, 3]
    assert events(run.engine, "resumed_suspect_checkpoint") == []
    assert not [
        a for a in rows(run.engine, m.alerts) if a["rule"] == "ResumedFromSuspectCheckpoint"
    ]


def test_a_restart_while_the_rollback_checks_its_result_ends_the_check(cluster: Any) -> None:
    # The rollback restored and checks NonFiniteLoss on the steps run again; the job
    # restarts before they ran (from the suspect checkpoint of step 40): the processes
    # that restored are gone, so the check ends, and the restart's own rollback follows.
    run = cluster(AUTO_ROLLBACK, rules=RULES, verify=True)
    for r in run.ranks:
        r.event("attempt_start")
    run.spike(at=35)
    run.train(40)
    run.exchange()
    (first,) = run.act()
    for _ in range(10):
        run.second()
        if "restored_at" in action(run, first["id"])["plan"]:
            break
    assert [r.restored[-1].checkpoint_step for r in run.ranks] == [30, 30]
    restart(run, resume_after=40)
    run.second(2)
    ended = action(run, first["id"])
    assert ended["state"] == "done", ended["history"]
    assert ended["result"]["check"].startswith("not checked: ") and ended["result"][
        "check"
    ].endswith("(the job restarted (attempt 2): the processes that restored are gone)")
    run.second()
    again = [a for a in run.act() if a["trigger"] == "rule:ResumedFromSuspectCheckpoint"]
    assert [a["plan"]["rollback"]["checkpoint_step"] for a in again] == [30], again
