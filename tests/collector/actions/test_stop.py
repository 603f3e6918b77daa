"""Stopping a run (SQLite and PostgreSQL): every rank ends after the same step, a rank
that does not answer is stopped at its next step, and a run whose ranks all ended is
done at once."""

from __future__ import annotations

from typing import Any

from trainwarden.agent.commands import STOPPED_EXIT_CODE

from .helpers import RUN, Cluster, commands


def asked_to_stop(run: Cluster) -> Cluster:
    """The run trained 5 steps, and an operator asked for it to stop."""
    run.train(5)
    run.exchange()
    with run.api() as client:
        made = client.post(
            f"/api/v1/runs/{RUN}/actions", json={"kind": "stop", "by": "ana", "reason": "done"}
        )
        assert made.status_code == 201, made.text
    return run


def test_a_stop_of_the_run_ends_every_rank_after_the_same_step(cluster: Any) -> None:
    """Rank 1 hears of the stop a step later than rank 0: each answers with its last
    step and holds; the commit names the newest + 1, rank 0 trains on to it, and both
    stop after it. Stopped one step apart, rank 1 would wait in that step's collective
    for rank 0 until the group's timeout wherever the first exit does not end the job."""
    run = asked_to_stop(cluster({"stop": {"mode": "auto"}}, world=3))
    (stop,) = run.act()
    assert stop["state"] == "executing"
    run.tick()
    run.exchange([0, 2])  # ranks 0 and 2 hear it after step 5
    run.train(6, ranks=[1])  # rank 1 finished step 6 first
    run.exchange([1])
    run.train(8)  # each holds at its next boundary: 6, 7, 6
    assert [r.last_step for r in run.ranks] == [6, 7, 6]
    assert [r.exit_code for r in run.ranks] == [None, None, None]
    run.exchange()
    (stop,) = run.act()
    assert stop["plan"]["barrier_step"] == 7, stop  # rank 1 answered with 6: it holds at 7
    run.exchange()
    run.train(20)
    assert [r.last_step for r in run.ranks] == [7, 7, 7]
    assert [r.exit_code for r in run.ranks] == [STOPPED_EXIT_CODE] * 3
    run.exchange()
    (stop,) = run.act()
    assert (stop["state"], stop["result"]["stopped_after"]) == ("done", {"0": 7, "1": 7, "2": 7})


def test_a_stop_that_a_rank_does_not_answer_stops_each_rank_at_its_next_step(
    cluster: Any,
) -> None:
    run = asked_to_stop(cluster({"stop": {"mode": "auto", "prepare_timeout": "10s"}}))
    run.act()
    run.ranks[1].silent = True  # a partitioned host: hears nothing, says nothing
    run.tick()
    run.exchange()
    run.train(8)
    assert run.ranks[0].last_step == 6  # holds
    run.exchange()
    run.tick(11)
    (stop,) = run.act()
    assert "did not answer within 10s" in stop["history"][-1]["detail"], stop["history"]
    sent = run.exchange()[0]
    assert [(c["type"], c.get("phase")) for c in sent] == [("stop", "abort"), ("stop", None)]
    run.train(9)
    assert (run.ranks[0].exit_code, run.ranks[0].last_step) == (STOPPED_EXIT_CODE, 6)
    run.exchange()
    run.tick(61)  # past STOP_TIMEOUT_S: rank 1 never heard it
    (stop,) = run.act()
    assert (stop["state"], stop["result"]) == (
        "done",
        {"stopped": [0], "already_gone": [], "no_answer": [1]},
    )


def test_stopping_a_run_whose_ranks_have_all_ended_is_done_at_once(cluster: Any) -> None:
    run = cluster({"stop": {"mode": "auto"}})
    run.train(5)
    for r in run.ranks:
        r.event("shutdown", reason="finished")
        r.exit_code = 0
    run.exchange()
    with run.api() as client:
        made = client.post(
            f"/api/v1/runs/{RUN}/actions", json={"kind": "stop", "by": "ana", "reason": "cleanup"}
        )
        assert made.status_code == 201, made.text
    run.tick()
    (stop,) = run.act()
    run.tick()
    (stop,) = run.act()
    assert (stop["state"], stop["result"]) == (
        "done",
        {"stopped": [], "already_gone": [], "no_answer": []},
    )
    assert commands(run, stop["id"]) == []
