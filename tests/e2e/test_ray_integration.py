"""Issue 54's proof for Ray Train: ``examples/ray_trainer.py`` (a ``TorchTrainer`` of 2
CPU workers, DDP over gloo, a tiny language model built in code on synthetic data) with
``tw_ray.wrap(train_loop)`` as its trainwarden line, against a real ``trainwarden
serve``; the collector's URL reaches the workers through ``ray.init(runtime_env=...)``.

One job, ``die@rank=1,step=25`` with ``FailureConfig(max_failures=1)``: worker 1 dies
as step 25 begins; Ray restarts the group, which resumes from the newest checkpoint Ray
registered (after step 19, or 9: Ray registers a report asynchronously). Both attempts
are on the run (attempt 2 with restart count 1, so the drill does not fire again), every
worker's loss arrives on every step of both attempts under the experiment's name, the
reported checkpoints are listed with their steps and Ray's paths, and the node's two
workers sent through one node relay.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ..helpers import start_serve, stop_serve, wait_for
from .launch import assert_resumed, finished_action, rank_steps, two_attempts

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ray_trainer.py"


def ray_environ(url: str, spool: Path) -> dict[str, str]:
    """The driver's environment (Ray passes every ``TRAINWARDEN_*`` to the workers): a
    spool of the test's own, so that nothing an earlier test's killed worker left is sent."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")},
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_URL": url,
        "TRAINWARDEN_SPOOL_DIR": str(spool),
        "TRAINWARDEN_FLUSH_INTERVAL": "0.5",
        "TRAINWARDEN_PROFILE_EVERY": "0",
        "RAY_DEDUP_LOGS": "0",
    }


def test_a_stop_ends_both_workers_after_the_same_step_and_ray_finishes(tmp_path: Path) -> None:
    """A stop of the run while Ray's two workers train in DDP lockstep: both stop after
    the same step (the two-phase stop), ``wrap`` returns from each worker's loop, and Ray
    ends the run as finished at once. Stopped a step apart, one worker would wait in that
    step's all_reduce until the group's timeout (30 minutes): Ray does not tear the group
    down when a worker's loop returns."""
    db, actions = tmp_path / "ray.db", tmp_path / "actions.yaml"
    actions.write_text("stop:\n  mode: auto\n")
    server = start_serve(
        f"sqlite:///{db}", tmp_path / "serve.log", env={"TRAINWARDEN_ACTIONS": str(actions)}
    )
    run, log, out = "ray-stop", tmp_path / "ray.log", tmp_path / "storage"
    cmd = [sys.executable, str(EXAMPLE), "--output-dir", str(out), "--name", run]
    cmd += ["--steps", "100000", "--save-steps", "100000", "--work-ms", "15"]
    cmd += ["--max-failures", "0"]
    try:
        with log.open("w") as said:
            # Each worker asks the collector itself, as on two nodes (one node's relay
            # would hand both the command in one answer): they hear it at different steps.
            env = {**ray_environ(server.url, tmp_path / "spool"), "TRAINWARDEN_RELAY": "off"}
            job = subprocess.Popen(cmd, stdout=said, stderr=subprocess.STDOUT, env=env)
            try:
                wait_for(
                    lambda: (server.get(f"/api/v1/runs/{run}").json().get("last_step") or 0) >= 20,
                    240,
                    "both workers training",
                )
                made = httpx.post(
                    f"{server.url}/api/v1/runs/{run}/actions",
                    json={"kind": "stop", "by": "test", "reason": "end of the experiment"},
                    timeout=10,
                )
                assert made.status_code == 201, made.text
                asked = time.monotonic()
                code = job.wait(120)
                took = time.monotonic() - asked
            finally:
                job.kill()
                job.wait(30)
        action = finished_action(server, run)
        attempts = server.get(f"/api/v1/runs/{run}/attempts").json()
        ranks = server.get(f"/api/v1/runs/{run}/ranks").json()
    finally:
        stop_serve(server)
    said = log.read_text()
    assert code == 0, said[-6000:]  # Ray ended the run as finished, not failed
    assert took < 60, (took, said[-3000:])  # nobody waited in a collective
    result = action["result"]
    barrier = result["barrier_step"]
    assert (action["state"], result["stopped"]) == ("done", [0, 1]), action
    assert result["stopped_after"] == {"0": barrier, "1": barrier}, action
    assert {r["rank"]: r["last_step"] for r in ranks} == {0: barrier, 1: barrier}, ranks
    (attempt,) = attempts
    assert attempt["outcome"] == "stopped", attempt
    assert said.count("stopped: this Ray Train worker's loop ends here") >= 2, said[-6000:]


def test_a_killed_worker_resumes_as_attempt_2_from_the_reported_checkpoint(
    tmp_path: Path,
) -> None:
    db = tmp_path / "ray.db"
    server = start_serve(f"sqlite:///{db}", tmp_path / "serve.log")
    run, log, out = "ray-restart", tmp_path / "ray.log", tmp_path / "storage"
    environ = {
        **ray_environ(server.url, tmp_path / "spool"),
        "TRAINWARDEN_DRILL": "die@rank=1,step=25",
    }
    cmd = [sys.executable, str(EXAMPLE), "--output-dir", str(out), "--name", run]
    cmd += ["--steps", "40", "--save-steps", "10", "--work-ms", "15", "--max-failures", "1"]
    try:
        with log.open("w") as said:
            code = subprocess.run(
                cmd, stdout=said, stderr=subprocess.STDOUT, env=environ, timeout=300
            ).returncode
        assert code == 0, log.read_text()[-6000:]
        attempts = two_attempts(server, run)
        checkpoints = server.get(f"/api/v1/runs/{run}/checkpoints").json()
        replaced = server.get(f"/api/v1/runs/{run}/replaced", metric="loss").json()
        first = server.get(f"/api/v1/runs/{run}/identity", attempt=1).json()
        second = server.get(f"/api/v1/runs/{run}/identity", attempt=2).json()
    finally:
        stop_serve(server)
    assert [a["number"] for a in attempts] == [1, 2]
    rows = rank_steps(db, run, 40)
    # every worker's own loss on every step (a step run twice: its latest execution)
    assert {(r.step, r.rank) for r in rows} == {(n, k) for n in range(40) for k in (0, 1)}
    assert all(r.loss is not None and r.grad_norm is not None for r in rows)
    assert len({r.loss for r in rows if r.step == 10}) == 2  # per worker, not synced
    # Attempt 2 resumed from the newest checkpoint Ray had registered when worker 1 died
    # as step 25 began (Ray registers a report asynchronously: the one after step 19, or
    # after step 9 when the death came first): the steps from there to 24 ran again on
    # both workers, their first runs replaced
    said = log.read_text()
    # (Ray echoes each worker's line twice: the same lines, counted once)
    resumed = sorted({line for line in said.splitlines() if "ray_trainer: resumed from" in line})
    assert len(resumed) == 2, said[-6000:]  # once a worker
    resumed = [line.split("ray_trainer: ", 1)[1] for line in resumed]
    assert resumed[0] == resumed[1], resumed
    at = int(resumed[0].rsplit(" ", 1)[1])
    # attempt 2 knew it was a restart (its restart count): the drill did not fire again
    assert "die@rank=1,step=25 skipped: the job was restarted" in said
    assert at in (10, 20) and resumed[0].split(" from ")[1].startswith(str(out / run)), resumed
    twice = dict(zip(replaced["step"], replaced["n"], strict=True))
    assert {s: twice[s] for s in range(at, 25)} == dict.fromkeys(range(at, 25), 2), replaced
    # ... and nothing before (worker 0's step 25, which its collective ended when its
    # peer died, may be there too)
    assert min(twice) == at and max(twice) <= 25, replaced
    assert_resumed(db, run, at=at, last=39)  # each attempt's sessions, both workers
    for identity in (first, second):
        config = identity["config"]
        assert config["framework"].startswith("ray 2.60"), config
        assert (config["experiment"], config["world_size"], config["steps"]) == (run, 2, 40)
    # Ray's checkpoints, by world rank 0, at the steps they hold and where Ray put them
    # (attempt 2 reported again from where it resumed).
    assert [c["step"] for c in checkpoints] == [9, 19, *range(at + 9, 40, 10)], checkpoints
    for c in checkpoints:
        assert c["path"].startswith(str(out / run / "checkpoint_")), c
        assert Path(c["path"], "state.pt").is_file(), c
    # The node's workers shared one relay an attempt (Ray sets LOCAL_WORLD_SIZE): local
    # rank 0's agent ran it, and the other worker found it (its health answered).
    relays = {
        line.rsplit(" ", 1)[1]
        for line in said.splitlines()
        if "this node's relay for the job listens on" in line
    }
    assert len(relays) == 2, relays  # one an attempt: the job key holds the attempt
    for relay in relays:
        askers = {
            line.split(")", 1)[0]
            for line in said.splitlines()
            if f"GET {relay}/relay/healthz" in line and "200 OK" in line
        }
        assert len(askers) == 2, (relay, askers)  # both workers of the attempt
