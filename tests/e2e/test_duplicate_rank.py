"""Issue 53: a double launch is a conflict, not a restart. Two 2-rank torchrun jobs of the
demo trainer under one run name, the second started while the first trains: the second's
ranks are refused (409, through their node relays), a ``rank_conflict`` event names both
processes of each rank, DuplicateRank fires within 10 s of the second job's start, and
every loss the collector kept is the first job's own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from trainwarden.agent.relay import Relay

from ..helpers import Server, start_serve, stop_serve, wait_for
from ..net import free_port
from .helpers import events, post_together, relay_batch
from .launch import demo_job

# The first job trains until the second has run beside it, then is stopped (SIGTERM):
# on a busy machine the second's start alone can take half a minute.
FIRST_STEPS, SECOND_STEPS = 3000, 10


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = start_serve(f"sqlite:///{tmp_path / 'tw.db'}", tmp_path / "serve.log")
    yield s
    stop_serve(s)


def job(server: Server, run: str, losses: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    cmd = demo_job(2, run, server.url, "--loss-log", str(losses), *args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINWARDEN_PROFILE_EVERY": "0"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def logged(folder: Path, rank: int) -> dict[int, float]:
    lines = (folder / f"rank-{rank}.jsonl").read_text().splitlines()
    return {d["step"]: d["loss"] for d in map(json.loads, lines)}


def test_a_second_job_under_the_same_run_name_is_refused_and_paged(
    server: Server, tmp_path: Path
) -> None:
    run = f"twice-{free_port()}"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = job(
        server, run, tmp_path / "first", first_log, "--steps", str(FIRST_STEPS), "--work-ms", "50"
    )
    second = None
    try:
        wait_for(
            lambda: (
                (got := server.get(f"/api/v1/runs/{run}")).status_code == 200
                and got.json()["last_step"] is not None
            ),
            90,
            "the first job's first steps",
        )
        launched = time.time()
        # Another seed: its losses differ from the first job's at every step.
        second = job(
            server,
            run,
            tmp_path / "second",
            second_log,
            "--steps",
            str(SECOND_STEPS),
            "--seed",
            "7",
        )
        conflicts = wait_for(
            lambda: len(found := events(server, run, "rank_conflict")) == 2 and found,
            60,
            "a rank_conflict event for each rank",
        )
        alert = wait_for(
            lambda: [
                a
                for a in server.get("/api/v1/alerts", run=run).json()
                if a["rule"] == "DuplicateRank" and a["state"] == "firing"
            ],
            30,
            "DuplicateRank firing",
        )[0]
        assert second.wait(120) == 0, second_log.read_text()[-3000:]  # the trainer goes on
        assert first.poll() is None, first_log.read_text()[-3000:]  # it ran beside the first
        first.send_signal(signal.SIGTERM)  # torchrun stops its ranks: they say goodbye
        first.wait(60)
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()

    # Each rank's event names both processes: the first job's holds it, the second's refused.
    assert sorted(e["rank"] for e in conflicts) == [0, 1]
    for e in conflicts:
        holder, refused = e["data"]["first"], e["data"]["second"]
        assert holder["pid"] != refused["pid"] and holder["session"] != refused["session"]
        assert holder["host"] and refused["host"] and holder["attempt"] == 1
        assert f"pid {holder['pid']}" in e["data"]["reason"]
        assert f"pid {refused['pid']}" in e["data"]["reason"]
        # Within 10 s of the second job's first batch (which came after its process
        # started, at or after ``launched``): the alert fired.
        assert refused["first_seen"] >= launched - 1
    started = min(e["data"]["second"]["first_seen"] for e in conflicts)
    assert alert["fired_at"] - started <= 10, (alert, started)
    assert alert["severity"] == "critical" and "pid" in alert["annotations"]["description"]
    assert "trainwarden: the collector refused this process's batches" in second_log.read_text()

    # Every step is the first job's, with the loss it computed: none of the second's.
    engine = create_engine(f"sqlite:///{tmp_path / 'tw.db'}")
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT s.rank, s.step, s.loss FROM rank_steps s JOIN runs r ON r.id = s.run_id"
                " WHERE r.name = :n"
            ),
            {"n": run},
        ).all()
        replaced = conn.execute(text("SELECT count(*) FROM replaced_steps")).scalar_one()
    engine.dispose()
    for rank in (0, 1):
        mine = logged(tmp_path / "first", rank)
        theirs = logged(tmp_path / "second", rank)
        stored = {step: loss for r, step, loss in rows if r == rank}
        # Every step the first job logged, up to the one SIGTERM cut short (sent, maybe
        # not logged; or logged, maybe not sent).
        last = max(stored)
        assert sorted(stored) == list(range(last + 1)) and last >= SECOND_STEPS
        assert set(mine) - set(stored) <= {last + 1}
        assert {s: stored[s] for s in mine if s in stored} == pytest.approx(
            {s: mine[s] for s in stored if s in mine}, rel=1e-6
        )
        assert sorted(theirs) == list(range(SECOND_STEPS))
        assert all(theirs[s] != pytest.approx(mine[s], rel=1e-6) for s in theirs)
    assert replaced == 0
    # One attempt: the second job's processes never joined it.
    attempts = server.get(f"/api/v1/runs/{run}/attempts").json()
    assert [len(a["processes"]) for a in attempts] == [2]
    timeline = server.get(f"/api/v1/runs/{run}/timeline").json()["entries"]
    said = [e["text"] for e in timeline if e.get("kind") == "rank_conflict"]
    assert len(said) == 2 and all("claimed by two live processes" in t for t in said), said


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_relay_hands_the_refusal_to_the_conflicting_rank_alone(live_server: Server) -> None:
    """A node's request through its relay: rank 1 is held by a live process of another
    job, so rank 1's agent gets the collector's 409 naming the holder, and rank 0's step
    is stored as if nothing happened."""
    run = f"relay-twice-{free_port()}"
    holder = relay_batch(run, 1, 0)
    holder["agent"].update(session="other-job", pid=4711, host="node-a", started_at=time.time())
    assert httpx.post(live_server.url + "/api/v1/ingest", json=holder).status_code == 200
    mine = [relay_batch(run, r, 0) for r in (0, 1)]
    for body in mine:  # started before the holder's request: both alive at once
        body["agent"].update(session=f"mine-{body['agent']['rank']}", started_at=time.time() - 60)
    with Relay(live_server.url, port=0, window_s=2.0, expect=2) as relay:
        answers = post_together(relay.url, mine)
    assert [a.status_code for a in answers] == [200, 409], [a.text for a in answers]
    refused = answers[1].json()
    assert (refused["rank"], refused["reason"]) == (1, "rank_conflict")
    assert refused["holder"]["pid"] == 4711 and refused["holder"]["session"] == "other-job"
    assert "pid 4711 on node-a" in refused["detail"]
    ranks = live_server.get(f"/api/v1/runs/{run}/ranks").json()
    assert [(r["rank"], r["session"]) for r in ranks] == [(0, "mine-0"), (1, "other-job")]
    (event,) = events(live_server, run, "rank_conflict")
    assert (event["data"]["first"]["pid"], event["data"]["second"]["session"]) == (4711, "mine-1")
