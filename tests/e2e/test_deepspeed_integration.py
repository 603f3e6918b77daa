"""Issue 54's proof for DeepSpeed: ``examples/deepspeed_trainer.py`` (a tiny language
model built in code, synthetic data, torch's AdamW) on 2 CPU ranks with gloo
(``DS_ACCELERATOR=cpu``), against a real ``trainwarden serve`` (one for the file), with
``tw_deepspeed.watch(engine)`` as its only trainwarden line.

- ZeRO-1 under torchrun and ZeRO-2 under the ``deepspeed`` launcher (which passes
  ``--local_rank=N``), each with ``loss_spike=50x@step=35``: both ranks' steps arrive
  with their own loss on every optimizer step, DeepSpeed's gradient norm, phases, tokens
  and, on the profiled steps, the comm split; the checkpoints ``engine.save_checkpoint``
  wrote are listed; LossSpike fires and every rank restores the same clean checkpoint
  through ``engine.load_checkpoint`` at the same step; the run ends with its loss back
  on trend.
- The ZeRO-1 job under torchrun (``--max-restarts 1``) also has ``die@rank=1,step=75``:
  after the rollback, rank 1 dies and the job resumes from its newest checkpoint as
  attempt 2 and finishes. (One job for both: a job's start, torch and DeepSpeed in each
  rank, is most of its CPU.)

The first DeepSpeed process on a machine JIT-builds the ``deepspeed_shm_comm`` op
(~135 s on 2 cores, then cached in ``~/.cache/torch_extensions``): ``scripts/install.sh``
builds it once; the fixture below builds it too if the cache is empty, before any job's
clock starts.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..helpers import Server, stop_serve
from .helpers import serve_with_rollback
from .launch import assert_replaced, finished_action, rank_steps, run_example, two_attempts

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deepspeed_trainer.py"
ENV = {"DS_ACCELERATOR": "cpu", "TRAINWARDEN_PROFILE_EVERY": "25"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    # DeepSpeed's CPU comm op, built once per machine (a no-op when cached).
    subprocess.run(
        [sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        check=True,
        timeout=600,
        capture_output=True,
    )
    tmp = tmp_path_factory.mktemp("ds")
    server = serve_with_rollback(f"sqlite:///{tmp / 'ds.db'}", tmp)
    yield server, tmp / "ds.db"
    stop_serve(server)


def deepspeed_launcher(server: Server, run: str, out: Path, log: Path, **how: Any) -> int:
    """The example under DeepSpeed's own launcher, 2 processes on this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2"]
    launcher += ["--master_port", str(port)]
    return run_example(
        EXAMPLE, server.url, run, out, log, launcher=launcher, env=ENV, timeout_s=300, **how
    )


def torchrun(server: Server, run: str, out: Path, log: Path, **how: Any) -> int:
    return run_example(EXAMPLE, server.url, run, out, log, env=ENV, timeout_s=300, **how)


@pytest.mark.parametrize("stage, launch", [(1, "torchrun"), (2, "deepspeed")])
def test_zero_steps_arrive_a_spike_is_rolled_back_and_under_torchrun_a_dead_rank_resumes(
    server: tuple[Server, Path], tmp_path: Path, stage: int, launch: str
) -> None:
    srv, db = server
    run, log, out = f"ds-zero{stage}-{launch}", tmp_path / "launch.log", tmp_path / "out"
    dies = launch == "torchrun"  # and resumes as attempt 2
    drill = "loss_spike=50x@step=35" + (";die@rank=1,step=75" if dies else "")
    how: dict[str, Any] = dict(drill=drill, steps=90, args=("--zero-stage", str(stage)))
    if dies:
        how["restarts"] = 1
    start = torchrun if launch == "torchrun" else deepspeed_launcher
    code = start(srv, run, out, log, **how)
    assert code == 0, log.read_text()[-5000:]
    action = finished_action(srv, run)
    attempts = two_attempts(srv, run) if dies else srv.get(f"/api/v1/runs/{run}/attempts").json()
    second = srv.get(f"/api/v1/runs/{run}/identity", attempt=2).json() if dies else {}
    series = srv.get(f"/api/v1/runs/{run}/series", metric="loss").json()
    replaced = srv.get(f"/api/v1/runs/{run}/replaced", metric="loss").json()
    checkpoints = srv.get(f"/api/v1/runs/{run}/checkpoints").json()
    identity = srv.get(f"/api/v1/runs/{run}/identity").json()

    assert action["state"] == "done", action
    ranks = action["result"]["ranks"]
    restored = {r["checkpoint_step"] for r in ranks.values()}
    barriers = {r["barrier_step"] for r in ranks.values()}
    assert sorted(ranks) == ["0", "1"] and len(restored) == len(barriers) == 1, action
    (ckpt,), (barrier,) = restored, barriers
    assert ckpt in (19, 29), action  # global_step20 or global_step30: before the spike at 35
    path = out / "checkpoints" / f"global_step{ckpt + 1}"
    assert log.read_text().count(f"rolled back to {path} (step {ckpt})") == 2

    rows = rank_steps(db, run, 30)
    assert {(r.step, r.rank) for r in rows} == {(n, k) for n in range(30) for k in (0, 1)}
    for r in rows:  # every optimizer step of each rank, its own loss
        assert r.loss is not None and r.grad_norm is not None, r
        assert r.tokens == 2 * 8 * 32, r  # two micro-batches of 8 sequences of 32 tokens
        assert r.fwd_s > 0 and r.bwd_s > 0 and r.opt_s > 0, r
    assert len({r.loss for r in rows if r.step == 10}) == 2  # per rank, not synced
    assert len({r.grad_norm for r in rows if r.step == 10}) == 1  # DeepSpeed's global norm
    profiled = [r for r in rows if r.comm_source == "profiler"]
    assert {r.rank for r in profiled} == {0, 1}, rows  # the sampled window: its 20th step
    for r in profiled:  # on a CPU every ZeRO collective runs on the training thread
        assert r.exposed_comm_s > 0 and r.overlapped_comm_s == 0, r
    print(
        f"ZeRO-{stage} profiled split (step, rank, exposed, overlapped):",
        [(r.step, r.rank, r.exposed_comm_s, r.overlapped_comm_s) for r in profiled],
    )
    assert [c["step"] for c in checkpoints][:3] == [9, 19, 29], checkpoints
    assert checkpoints[0]["path"] == str(out / "checkpoints" / "global_step10")
    config = identity["config"]
    assert (config["zero_stage"], config["world_size"]) == (stage, 2), config
    assert config["zero_optimization"]["stage"] == stage, config
    assert config["framework"].startswith("deepspeed 0.19."), config

    # load_checkpoint set global_steps back: the steps after the checkpoint ran again on
    # both ranks (their first runs, the spike among them, kept as replaced), and the run
    # went on to its last step with the loss back on trend.
    # Under torchrun rank 1 then died as step 75 began, and attempt 2 resumed from
    # global_step70 (the weights after step 69): steps 70 to 74 ran again on both ranks.
    assert_replaced(replaced, rollback=(ckpt, barrier), died=75 if dies else None)
    assert [a["number"] for a in attempts] == ([1, 2] if dies else [1]), attempts
    if dies:
        assert second["config"]["framework"].startswith("deepspeed "), second
    loss = dict(zip(series["step"], series["median"], strict=True))
    assert max(loss) == 89
    before = statistics.median(loss[s] for s in range(25, 35))
    after = statistics.median(loss[s] for s in range(80, 90))
    assert after < 1.1 * before, (before, after)
