"""Every process knows who it is under launchers that set no ``RANK`` (issue 53): a user's
job, unchanged but for the lines the docs ask for, started as its framework starts it,
against a real ``trainwarden serve``:

- ``torch.multiprocessing.spawn`` with ``init_process_group(rank=r, world_size=2)`` and
  ``tw.init`` first (tests/e2e/user_jobs/spawn_ddp.py);
- a Lightning ``Trainer(devices=2, strategy="ddp")`` run as ``python train.py``: Lightning's
  own launcher starts the second process (user_jobs/lightning_ddp.py);
- Accelerate's ``notebook_launcher`` (user_jobs/accelerate_notebook.py).

Each reports 2 ranks of world 2, their local ranks 0 and 1, each rank's own loss on every
step (equal to what the rank itself saw), and no ``restart`` event. A hang drill under
``mp.spawn`` is still named by its culprit (the Flight Recorder stayed on)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..helpers import Server, start_serve, stop_serve, wait_for
from ..net import free_port
from .helpers import events

JOBS = Path(__file__).resolve().parent / "user_jobs"
STEPS = 20


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """A collector on SQLite: what these tests check is the agent's, not the database's."""
    started = start_serve(f"sqlite:///{tmp_path / 'runs.db'}", tmp_path / "serve.log")
    yield started
    stop_serve(started)


def launch(
    server: Server, run: str, script: str, args: list[str], log: Path, **env: str
) -> subprocess.Popen[bytes]:
    """The job as its user starts it: ``python script.py ...`` with the collector and the
    run in ``TRAINWARDEN_*`` variables, and no launcher variables of this test's own."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
    }
    clean.update(
        TRAINWARDEN_URL=server.url,
        TRAINWARDEN_RUN=run,
        TRAINWARDEN_PROFILE_EVERY="0",
        TRAINWARDEN_HEARTBEAT="0.5",
        **env,
    )
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, str(JOBS / script), *args],
            env=clean,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the job's ranks go with it: os.killpg
        )


def assert_two_ranks_each_its_own(server: Server, run: str, out: Path) -> None:
    detail = wait_for(
        lambda: (d := server.get(f"/api/v1/runs/{run}").json())["status"] == "finished" and d,
        30,
        "the run finished",
    )
    assert (detail["world_size"], detail["ranks_seen"]) == (2, 2), detail
    ranks = sorted((r["rank"], r["local_rank"], r["last_step"]) for r in detail["ranks"])
    assert ranks == [(0, 0, STEPS - 1), (1, 1, STEPS - 1)], ranks
    assert len({r["pid"] for r in detail["ranks"]}) == 2
    for rank in (0, 1):
        logged = {
            int(k): v for k, v in json.loads((out / f"losses-{rank}.json").read_text()).items()
        }
        series = server.get(f"/api/v1/runs/{run}/ranks/{rank}/series", metric="loss").json()
        stored = dict(zip(series["step"], series["value"], strict=True))
        assert sorted(stored) == list(range(STEPS)), (rank, stored)
        assert stored == pytest.approx(logged, rel=1e-6), rank
    assert events(server, run, "restart") == []
    assert events(server, run, "rank_conflict") == []
    starts = events(server, run, "start")
    assert sorted(e["rank"] for e in starts) == [0, 1]
    assert {e["data"]["rank_from"] for e in starts} <= {"process group", "argument"}


def finish(job: subprocess.Popen[bytes], log: Path, timeout: float = 240) -> None:
    try:
        code = job.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        raise AssertionError(log.read_text()[-4000:]) from None
    assert code == 0, log.read_text()[-4000:]


def test_an_mp_spawn_job_reports_each_rank_from_its_process_group(
    server: Server, tmp_path: Path
) -> None:
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    args = [str(out), "--port", str(free_port()), "--steps", str(STEPS)]
    finish(launch(server, "spawn-ddp", "spawn_ddp.py", args, log), log)
    assert_two_ranks_each_its_own(server, "spawn-ddp", out)
    starts = events(server, "spawn-ddp", "start")
    assert {e["data"]["rank_from"] for e in starts} == {"process group"}


def test_a_lightning_job_started_by_lightning_itself_reports_both_ranks(
    server: Server, tmp_path: Path
) -> None:
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    args = [str(out), "--steps", str(STEPS)]
    job = launch(server, "pl-own", "lightning_ddp.py", args, log, MASTER_PORT=str(free_port()))
    finish(job, log)
    assert_two_ranks_each_its_own(server, "pl-own", out)


def test_an_accelerate_notebook_launcher_job_reports_both_ranks(
    server: Server, tmp_path: Path
) -> None:
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    args = [str(out), "acc-notebook", "--steps", str(STEPS)]
    job = launch(
        server,
        "acc-notebook",
        "accelerate_notebook.py",
        args,
        log,
        MASTER_PORT=str(free_port()),
    )
    finish(job, log)
    assert_two_ranks_each_its_own(server, "acc-notebook", out)


def test_a_hang_under_mp_spawn_is_named_by_its_culprit(server: Server, tmp_path: Path) -> None:
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    args = [str(out), "--port", str(free_port()), "--steps", "40"]
    job = launch(
        server,
        "spawn-hang",
        "spawn_ddp.py",
        args,
        log,
        TRAINWARDEN_DRILL="hang@rank=1,step=12,for=20s",
    )
    try:
        verdict = wait_for(
            lambda: (
                (v := server.get("/api/v1/runs/spawn-hang/collectives").json().get("verdict"))
                and v["kind"] not in ("none", "incomplete")  # every rank's ring in
                and v
            ),
            60,
            "the hang's verdict",
        )
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(30)
    assert verdict["kind"] == "culprit" and verdict["culprits"] == [1], verdict
    assert verdict["victims"] == [0], verdict
