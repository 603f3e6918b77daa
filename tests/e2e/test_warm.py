"""The warm launcher (``tests/warm.py``) that the drills start their ranks with, and
``start_serve`` its collectors: a process forked warm must run as ``python -m`` runs it:
the caller's arguments, environment, working directory and output; the agent's last
flush at exit; its exit code and signals as ``Popen`` reports them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .. import warm
from ..helpers import Server, start_serve, stop_serve


@pytest.fixture(autouse=True)
def _warm_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the warm launcher: on even in a run with
    TRAINWARDEN_TEST_WARM=0 (the last test turns it off itself)."""
    monkeypatch.setenv("TRAINWARDEN_TEST_WARM", "1")


def parent_pid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def demo(server: Server, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainwarden.agent.demo_trainer",
        "--url",
        server.url,
        "--data-delay",
        "0",
        *args,
    ]


def one_rank_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINWARDEN_FLUSH_INTERVAL": "60"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TRAINWARDEN_RUN"):
        env.pop(name, None)
    return {**env, **extra}


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_warm_rank_runs_as_python_m_would(live_server: Server, tmp_path: Path) -> None:
    # The run's name only in the environment, a flush interval longer than the run: the
    # steps reach the collector through the agent's flush in tw.shutdown.
    log = tmp_path / "rank.log"
    with log.open("w") as out:
        proc = warm.popen(
            demo(live_server, "--steps", "6"),
            env=one_rank_env(TRAINWARDEN_RUN="warm-env"),
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    assert isinstance(proc, warm.WarmProcess)  # forked by the warm process, not by this one
    assert parent_pid(proc.pid) not in (os.getpid(), 1)
    assert proc.wait(120) == 0, log.read_text()[-3000:]
    assert proc.poll() == 0 and proc.returncode == 0
    run = live_server.get("/api/v1/runs/warm-env").json()
    assert run["last_step"] == 5 and run["status"] == "finished", run


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_warm_rank_that_crashes_reports_as_a_fresh_one_does(
    live_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An uncaught exception after tw.init, no tw.shutdown: what the collector learns goes
    # through the agent's sys.excepthook and its flush at interpreter exit. The same
    # trainer, warm and fresh, must end its attempt the same way.
    not_a_folder = tmp_path / "not-a-folder"
    not_a_folder.write_text("")
    ended = {}
    for how in ("1", "0"):
        monkeypatch.setenv("TRAINWARDEN_TEST_WARM", how)
        run = f"warm-crash-{how}"
        log = tmp_path / f"{run}.log"
        with log.open("w") as out:
            proc = warm.popen(
                demo(
                    live_server,
                    *("--steps", "6", "--checkpoint-every", "2"),
                    *("--checkpoint-dir", str(not_a_folder)),
                ),
                env=one_rank_env(TRAINWARDEN_RUN=run),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        assert isinstance(proc, warm.WarmProcess) == (how == "1")
        assert proc.wait(120) == 1, log.read_text()[-3000:]
        assert "FileExistsError" in log.read_text()  # the traceback, on stderr
        (attempt,) = live_server.get(f"/api/v1/runs/{run}/attempts").json()
        (process,) = attempt["processes"]
        ended[how] = (
            attempt["exit_reason"],
            attempt["exit_detail"].split(" at step ")[1],
            process["exit_code"],  # said by the agent's excepthook only
        )
    assert ended["1"] == ended["0"], ended
    assert ended["1"][0] == "exception" and "FileExistsError" in ended["1"][1], ended
    assert ended["1"][2] == 1, ended


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_warm_rank_reports_its_exit_code_signals_and_timeouts(
    live_server: Server, tmp_path: Path
) -> None:
    # An argument the trainer refuses: argparse's usage on stderr, into the log; exit 2.
    log = tmp_path / "bad.log"
    with log.open("w") as out:
        bad = warm.popen(
            demo(live_server, "--steps", "many"),
            env=one_rank_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    assert bad.wait(120) == 2
    assert "argument --steps: invalid int value: 'many'" in log.read_text()

    # A long run: wait(timeout) times out, kill() ends it, and the code is -SIGKILL.
    with (tmp_path / "long.log").open("w") as out:
        long = warm.popen(
            demo(live_server, "--run-name", "warm-long", "--steps", "100000"),
            env=one_rank_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    with pytest.raises(subprocess.TimeoutExpired):
        long.wait(0.5)
    assert long.poll() is None
    long.kill()
    assert long.wait(30) == -signal.SIGKILL
    long.kill()  # already reaped: nothing is sent to a pid that may be another's now


def test_a_warm_collector_serves_and_stops_as_a_fresh_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # start_serve forks serve warm: its environment (TRAINWARDEN_EXTERNAL_URL makes the
    # rules' runbook links absolute), options, output, pid and exit must be a fresh one's.
    seen = {}
    for how in ("1", "0"):
        monkeypatch.setenv("TRAINWARDEN_TEST_WARM", how)
        log = tmp_path / f"serve-{how}.log"
        server = start_serve(
            f"sqlite:///{tmp_path / f'warm-{how}.db'}",
            log,
            env={"TRAINWARDEN_EXTERNAL_URL": f"https://tw{how}.example.org"},
            log_level="info",
        )
        try:
            assert isinstance(server.proc, warm.WarmProcess) == (how == "1")
            if how == "1":
                assert parent_pid(server.proc.pid) not in (os.getpid(), 1)
            health = server.get("/healthz").json()
            assert health["pid"] == server.proc.pid, health
            rules = server.get("/api/v1/rules").json()
            links = {r["runbook_url"].split("/runbooks/")[0] for r in rules}
        finally:
            stop_serve(server)
        said = log.read_text()
        seen[how] = (
            links == {f"https://tw{how}.example.org"},
            "trainwarden collector: dashboard http://127.0.0.1:" in said,
            "Application startup complete" in said,  # --log-level info reached uvicorn
            server.proc.returncode,
        )
    assert seen["1"] == seen["0"] == (True, True, True, -signal.SIGTERM), seen
    # serve --workers forks its own workers: started as users start it
    with (tmp_path / "workers.log").open("w") as out:
        many = warm.popen(
            [sys.executable, "-m", "trainwarden.collector.cli", "serve", "--workers", "2", "-h"],
            stdout=out,
        )
    assert isinstance(many, subprocess.Popen)
    assert many.wait(120) == 0


def test_a_command_that_is_not_a_warm_module_starts_fresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = warm.popen([sys.executable, "-c", "print('fresh')"], stdout=subprocess.DEVNULL)
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(60) == 0
    monkeypatch.setenv("TRAINWARDEN_TEST_WARM", "0")  # the whole suite can run this way
    with (tmp_path / "off.log").open("w") as out:
        cold = warm.popen(
            [sys.executable, "-m", "trainwarden.agent.demo_trainer", "--help"], stdout=out
        )
    assert isinstance(cold, subprocess.Popen)
    assert cold.wait(120) == 0
    assert "--run-name" in (tmp_path / "off.log").read_text()
