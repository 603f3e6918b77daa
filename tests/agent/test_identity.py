"""Run identity: the attempt_start event (config, tags, code version, environment, the
launcher's attempt) and the attempt_end event with the reason the process ended."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trainwarden.agent as tw
from trainwarden.agent import identity
from trainwarden.agent.config import MAX_CONFIG_BYTES

from ..net import closed_port
from .helpers import RecordingTransport

LAUNCHER_ENV = (
    "TRAINWARDEN_ATTEMPT",
    "TRAINWARDEN_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID",
    "SLURM_RESTART_COUNT",
    "TRAINWARDEN_TAGS",
    "TRAINWARDEN_DATA_SNAPSHOT",
    "TRAINWARDEN_CODE_VERSION",
)


@pytest.fixture(autouse=True)
def _clean_agent(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "TRAINWARDEN_URL",
        "TRAINWARDEN_RUN",
        *LAUNCHER_ENV,
    ):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def _events(transport: RecordingTransport, kind: str) -> list[dict[str, Any]]:
    return [e for e in transport.events() if e["kind"] == kind]


def _run(**kwargs: Any) -> RecordingTransport:
    transport = RecordingTransport()
    agent = tw.init(
        run="ident", transport=transport, flush_interval_s=0.05, profile_every=0, **kwargs
    )
    for i in range(3):
        with tw.step(i):
            pass
    assert agent.started_at <= time.time()
    tw.shutdown(timeout_s=5)
    return transport


def test_attempt_start_is_the_first_event_with_the_whole_identity() -> None:
    transport = _run(
        config={"lr": 3e-4, "batch_size": 64},
        tags=["baseline", "sweep"],
        data_snapshot="s3://data/v7",
    )
    events = transport.events()
    assert events[0]["kind"] == "attempt_start"
    first = next(b for b in transport.bodies if b["events"] or b["steps"])  # not a heartbeat
    assert first["events"][0]["kind"] == "attempt_start"  # before any step
    (start,) = _events(transport, "attempt_start")
    assert start["step"] is None and start["severity"] == "info"
    assert start["ts"] == transport.bodies[0]["agent"]["started_at"]  # the process's start
    data = start["data"]
    assert set(data) == {
        "attempt",
        "restart_count",
        "config",
        "tags",
        "data_snapshot",
        "data_mixture",
        "dataset_size",
        "code",
        "env",
        "packages",
    }
    assert (data["attempt"], data["restart_count"]) == (None, None)  # no launcher here
    assert data["config"] == {"lr": 3e-4, "batch_size": 64}
    assert data["tags"] == ["baseline", "sweep"]
    assert data["data_snapshot"] == "s3://data/v7"
    assert (data["data_mixture"], data["dataset_size"]) == (None, None)  # none declared
    assert set(data["code"]) == {"commit", "dirty", "branch", "root"}
    env = data["env"]
    assert set(env) == {
        "python",
        "torch",
        "cuda",
        "nccl",
        "gpu",
        "gpu_count",
        "driver",
        "host",
        "platform",
        "world_size",
        "packages_hash",
    }
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    assert env["torch"] == torch.__version__ and env["cuda"] == torch.version.cuda
    assert env["world_size"] == 1 and env["host"] == transport.bodies[0]["agent"]["host"]
    assert env["platform"]
    packages = data["packages"]
    assert packages == sorted(packages) and any(p.startswith("torch==") for p in packages)
    assert env["packages_hash"] == hashlib.sha256("\n".join(packages).encode()).hexdigest()
    (end,) = _events(transport, "attempt_end")
    assert events[-1] is end


def test_only_rank_0_sends_the_package_list_every_rank_sends_its_hash() -> None:
    rank0 = _run(rank=0, world_size=2)
    rank1 = _run(rank=1, world_size=2)
    (d0,) = [e["data"] for e in _events(rank0, "attempt_start")]
    (d1,) = [e["data"] for e in _events(rank1, "attempt_start")]
    assert "packages" in d0 and "packages" not in d1
    assert d0["env"]["packages_hash"] == d1["env"]["packages_hash"] is not None
    assert d0["env"]["world_size"] == d1["env"]["world_size"] == 2


@pytest.mark.parametrize(
    ("env", "key", "restarts"),
    [
        (
            {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"},
            "torchelastic:job7:1",
            1,
        ),
        ({"SLURM_JOB_ID": "4242"}, "slurm:4242:0", 0),
        ({"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "3"}, "slurm:4242:3", 3),
        ({"TRAINWARDEN_ATTEMPT": "mine-2", "SLURM_JOB_ID": "4242"}, "mine-2", 0),
        # the Ray Train integration's: the key and the count it learned in the worker
        ({"TRAINWARDEN_ATTEMPT": "ray:x:pg2", "TRAINWARDEN_RESTART_COUNT": "1"}, "ray:x:pg2", 1),
        # a launcher's own count wins
        (
            {"TRAINWARDEN_ATTEMPT": "m", "SLURM_JOB_ID": "4", "TRAINWARDEN_RESTART_COUNT": "5"},
            "m",
            0,
        ),
        ({"TORCHELASTIC_RUN_ID": "job7"}, None, None),  # no restart count: not torchelastic's
    ],
)
def test_the_launchers_attempt_key(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], key: str | None, restarts: int | None
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (start,) = _events(_run(), "attempt_start")
    assert (start["data"]["attempt"], start["data"]["restart_count"]) == (key, restarts)


def _git(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(
        [
            "git",
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@example.com",
            "-c",
            "commit.gpgsign=false",
            "-C",
            str(repo),
            *args,
        ],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()


def test_the_code_version_of_a_git_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "trainer"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "exp")
    (repo / "train.py").write_text("print('hi')\n")
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-q", "-m", "first")
    sha = _git(repo, "rev-parse", "HEAD")
    monkeypatch.setattr(sys, "argv", [str(repo / "train.py")])  # run as `python train.py`
    monkeypatch.chdir(tmp_path)  # from elsewhere: the script's repository counts
    (clean,) = _events(_run(), "attempt_start")
    assert clean["data"]["code"] == {
        "commit": sha,
        "dirty": False,
        "branch": "exp",
        "root": str(repo.resolve()),
    }

    (repo / "train.py").write_text("print('changed')\n")
    (repo / "notes.txt").write_text("untracked files do not count\n")
    assert identity.code_version()["dirty"] is True

    monkeypatch.setenv("TRAINWARDEN_CODE_VERSION", "v1.2.3")  # an image built from a tag
    assert identity.code_version()["commit"] == "v1.2.3"
    monkeypatch.setattr(sys, "argv", ["-c"])
    monkeypatch.chdir(tmp_path)  # no repository anywhere: only the override
    assert identity.code_version() == {
        "commit": "v1.2.3",
        "dirty": None,
        "branch": None,
        "root": None,
    }


class Precision:
    def __str__(self) -> str:
        return "bf16-mixed"


@dataclass
class Optim:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)


def test_a_config_becomes_plain_json_whatever_it_holds() -> None:
    config = {
        "dtype": torch.bfloat16,
        "out": Path("/ckpt/run"),
        "lr": np.float32(0.5),
        "steps": np.int64(1000),
        "amp": np.bool_(True),
        "nan": float("nan"),
        "inf": -math.inf,
        "layers": (1, 2),
        "drop": {3, 1},
        "precision": Precision(),
        "optim": Optim(),
        7: "int key",
        "huge": 2**70,
        "nested": {"a": [torch.float32, None]},
    }
    (start,) = _events(_run(config=config), "attempt_start")
    assert start["data"]["config"] == {
        "dtype": "torch.bfloat16",
        "out": "/ckpt/run",
        "lr": 0.5,
        "steps": 1000,
        "amp": True,
        "nan": "nan",
        "inf": "-inf",
        "layers": [1, 2],
        "drop": [1, 3],
        "precision": "bf16-mixed",
        "optim": {"lr": 1e-3, "betas": [0.9, 0.95]},
        "7": "int key",
        "huge": str(2**70),
        "nested": {"a": ["torch.float32", None]},
    }
    json.dumps(start["data"], allow_nan=False)  # the strict encoder takes it


def test_tags_and_data_snapshot_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWARDEN_TAGS", "nightly, llama ,,nightly")
    monkeypatch.setenv("TRAINWARDEN_DATA_SNAPSHOT", "fineweb@2026-11-01")
    (start,) = _events(_run(), "attempt_start")
    assert start["data"]["tags"] == ["nightly", "llama"]
    assert start["data"]["data_snapshot"] == "fineweb@2026-11-01"
    assert start["data"]["config"] is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": [("lr", 1)]}, "config must be a mapping"),
        ({"config": "lr=1"}, "config must be a mapping"),
        ({"config": {"vocab": "x" * (MAX_CONFIG_BYTES + 1)}}, "KiB limit"),
        ({"tags": "a,b"}, "tags must be a list of strings"),
        ({"tags": ["a", 1]}, "tags must be a list of strings"),
        ({"tags": [""]}, "tag '' is not valid"),
        ({"data_snapshot": 7}, "data_snapshot must be a string"),
    ],
)
def test_wrong_identity_arguments_fail_at_init(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(tw.ConfigError, match=message):
        tw.init(run="ident", transport=RecordingTransport(), **kwargs)


def test_identity_that_cannot_be_read_leaves_fields_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> list[str]:
        raise RuntimeError("metadata is broken")

    monkeypatch.setattr(identity, "package_lines", broken)
    monkeypatch.setattr(identity, "GIT_TIMEOUT_S", 1e-6)  # git never answers in time
    (start,) = _events(_run(), "attempt_start")
    assert start["data"]["env"]["packages_hash"] is None and start["data"]["packages"] == []
    assert start["data"]["code"]["commit"] is None


def test_attempt_end_completed_and_stopped() -> None:
    (end,) = _events(_run(), "attempt_end")
    assert end["data"] == {"reason": "completed", "detail": "", "exit_code": None, "last_step": 2}

    transport = RecordingTransport()
    agent = tw.init(run="ident", transport=transport, flush_interval_s=0.05, profile_every=0)
    with tw.step(0):
        pass
    agent.commands.receive([{"id": 1, "type": "stop", "reason": "node evicted"}])
    with pytest.raises(SystemExit) as stopped, tw.step(1):
        pass
    assert stopped.value.code == tw.STOPPED_EXIT_CODE
    (end,) = _events(transport, "attempt_end")
    assert end["data"] == {
        "reason": "stopped",
        "detail": "node evicted",
        "exit_code": tw.STOPPED_EXIT_CODE,
        "last_step": 1,
    }


def test_attempt_end_is_when_shutdown_was_called_not_after_its_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Shutdown waits for the identity (up to 2 s) before the goodbye; the attempt's end,
    which bounds its GPU-hours, is still the moment the trainer called it."""

    def slow(config: Any, fields: Any, **kwargs: Any) -> None:
        time.sleep(0.6)

    monkeypatch.setattr(identity, "collect", slow)
    transport = RecordingTransport()
    tw.init(run="ident", transport=transport, flush_interval_s=0.05, profile_every=0)
    with tw.step(0):
        pass
    called = time.time()
    tw.shutdown(timeout_s=5)
    returned = time.time()
    (end,) = _events(transport, "attempt_end")
    assert returned - called >= 0.4  # it did wait for the identity
    assert called <= end["ts"] < called + 0.1, (end["ts"] - called, returned - called)
    assert end["data"]["reason"] == "completed"


def test_shutdown_in_a_finally_while_an_exception_propagates_is_an_exception_end() -> None:
    transport = RecordingTransport()
    tw.init(run="ident", transport=transport, flush_interval_s=0.05, profile_every=0)
    with pytest.raises(KeyError):
        try:
            with tw.step(0):
                pass
            raise KeyError("shard-17")
        finally:
            tw.shutdown()
    (end,) = _events(transport, "attempt_end")
    assert end["data"] == {
        "reason": "exception",
        "detail": "KeyError: 'shard-17'",
        "exit_code": 1,
        "last_step": 0,
    }


# -- how a real process ends: subprocesses whose records land in the spool ----------------


def _trainer(spool: Path, body: str, *, drill: str | None = None) -> str:
    return textwrap.dedent(f"""
        import sys, time
        import trainwarden.agent as tw
        tw.init(run="end", url="http://127.0.0.1:{closed_port()}", flush_interval_s=0.05,
                request_timeout_s=0.5, profile_every=0, spool_dir={str(spool)!r},
                drill={drill!r}, config={{"lr": 0.1}})
    """) + textwrap.dedent(body)


def _spooled_events(spool: Path) -> list[dict[str, Any]]:
    batches = [json.loads(p.read_text()) for p in sorted((spool / "end" / "rank-0").glob("*.json"))]
    return [e for b in batches for e in b["events"]]


def _run_trainer(script: str, *, sigterm: bool = False) -> int:
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, stderr=subprocess.PIPE
    )
    try:
        if sigterm:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
        return proc.wait(60)
    finally:
        proc.kill()
        proc.communicate()


STEPS = textwrap.dedent("""
    for step in range(5):
        with tw.step(step):
            time.sleep(0.01)
""")


@pytest.mark.parametrize(
    ("ending", "exit_status", "end"),
    [
        ("", 0, {"reason": "completed", "detail": "", "exit_code": None, "last_step": 4}),
        (
            "raise ValueError('bad batch ' + 'x' * 500)",
            1,
            {
                "reason": "exception",
                "detail": "ValueError: bad batch " + "x" * 278,
                "exit_code": 1,
                "last_step": 4,
            },
        ),
    ],
    ids=["completed", "exception"],
)
def test_a_process_that_ends_says_why(
    tmp_path: Path, ending: str, exit_status: int, end: dict[str, Any]
) -> None:
    assert _run_trainer(_trainer(tmp_path, STEPS + ending + "\n")) == exit_status
    events = _spooled_events(tmp_path)
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "attempt_start" and kinds.count("attempt_end") == 1
    assert events[0]["data"]["config"] == {"lr": 0.1}
    assert next(e for e in events if e["kind"] == "attempt_end")["data"] == end
    assert len(end["detail"]) <= 300


def test_sigterm_is_the_attempts_end(tmp_path: Path) -> None:
    script = _trainer(
        tmp_path,
        """
        step = 0
        while True:
            with tw.step(step):
                time.sleep(0.002)
            if step == 20:
                print("ready", flush=True)
            step += 1
    """,
    )
    assert _run_trainer(script, sigterm=True) == -signal.SIGTERM
    events = _spooled_events(tmp_path)
    assert events[0]["kind"] == "attempt_start"
    (end,) = [e for e in events if e["kind"] == "attempt_end"]
    assert end["data"]["reason"] == "sigterm" and end["data"]["exit_code"] == 128 + signal.SIGTERM
    assert end["data"]["last_step"] >= 20


def test_the_die_drill_is_a_crash_without_a_goodbye(tmp_path: Path) -> None:
    from trainwarden.agent.drills import DIE_EXIT_CODE

    script = _trainer(tmp_path, STEPS, drill="die@rank=0,step=3")
    assert _run_trainer(script) == DIE_EXIT_CODE
    kinds = [e["kind"] for e in _spooled_events(tmp_path)]
    assert "attempt_start" in kinds and "drill" in kinds
    assert "attempt_end" not in kinds and "shutdown" not in kinds
