"""Issue 36's proof for PyTorch Lightning: ``examples/lightning_trainer.py`` (a tiny
language model built in code, synthetic data) under ``torchrun --nproc-per-node 2`` on
CPU with gloo (``strategy="ddp"``, and FSDP2: ``ModelParallelStrategy`` with
``fully_shard``), against a real ``trainwarden serve``, with ``TrainwardenCallback`` as
its only trainwarden line.

- Both ranks' steps arrive with the per-rank loss on every optimizer step, the gradient
  norm, phases, tokens and (DDP) the comm split; checkpoints appear; ``attempt_start``
  carries the module's hyperparameters and the Trainer's facts.
- ``loss_spike=50x@step=35``, under DDP and under FSDP2: LossSpike fires, every rank
  restores the same checkpoint in process at the same step (FSDP2's: a distributed
  checkpoint folder, its shards), and the run finishes with its loss back on trend.
- Under DDP the same job also has ``die@rank=1,step=75`` under ``--max-restarts 1``: the
  job resumes from its newest checkpoint (``ckpt_path="last"``) as a second attempt and
  finishes. (One job for both: a job's start, torch and Lightning in each rank, is most
  of its CPU.)
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from ..helpers import Server, stop_serve
from .helpers import serve_with_rollback
from .launch import assert_replaced, finished_action, run_example, two_attempts

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_trainer.py"


def torchrun(server: Server, run: str, out: Path, log: Path, **how: Any) -> int:
    """The example under torchrun (``how``: :func:`.launch.run_example`'s options)."""
    return run_example(EXAMPLE, server.url, run, out, log, **how)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_steps_arrive_a_spike_is_rolled_back_and_under_ddp_a_dead_rank_resumes(
    tmp_path: Path, strategy: str
) -> None:
    server = serve_with_rollback(f"sqlite:///{tmp_path / 'pl.db'}", tmp_path)
    run, log, out = f"pl-rollback-{strategy}", tmp_path / "torchrun.log", tmp_path / "out"
    dies = strategy == "ddp"  # and resumes as attempt 2
    try:
        code = torchrun(
            server,
            run,
            out,
            log,
            drill="loss_spike=50x@step=35" + (";die@rank=1,step=75" if dies else ""),
            steps=120,
            restarts=1 if dies else 0,
            args=("--strategy", strategy),
        )
        assert code == 0, log.read_text()[-5000:]
        action = finished_action(server, run)
        attempts = (
            two_attempts(server, run) if dies else server.get(f"/api/v1/runs/{run}/attempts").json()
        )
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        replaced = server.get(f"/api/v1/runs/{run}/replaced", metric="loss").json()
        checkpoints = server.get(f"/api/v1/runs/{run}/checkpoints").json()
        identity = server.get(f"/api/v1/runs/{run}/identity").json()
        second = server.get(f"/api/v1/runs/{run}/identity", attempt=2).json() if dies else {}
    finally:
        stop_serve(server)
    assert action["state"] == "done", action
    restored = {r["checkpoint_step"] for r in action["result"]["ranks"].values()}
    barriers = {r["barrier_step"] for r in action["result"]["ranks"].values()}
    assert sorted(action["result"]["ranks"]) == ["0", "1"] and len(restored) == len(barriers) == 1
    (ckpt,), (barrier,) = restored, barriers
    assert ckpt in (19, 29), action  # step=20 or step=30: before the spike at 35
    said = log.read_text()
    path = out / "checkpoints" / f"epoch=0-step={ckpt + 1}.ckpt"
    assert said.count(f"rolled back to {path} (step {ckpt})") == 2, said[-3000:]

    engine = create_engine(f"sqlite:///{tmp_path / 'pl.db'}")
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT s.step, s.rank, s.loss, s.grad_norm, s.tokens, s.fwd_s, s.bwd_s, s.opt_s,"
                " s.comm_source, s.exposed_comm_s FROM rank_steps s JOIN runs r ON r.id = s.run_id"
                " WHERE r.name = :n AND s.step < 30"
            ),
            {"n": run},
        ).all()
    assert {(r.step, r.rank) for r in rows} == {(n, k) for n in range(30) for k in (0, 1)}
    for r in rows:  # every optimizer step of each rank, its own loss
        assert r.loss is not None and r.grad_norm is not None, r
        assert r.tokens == 2 * 8 * 32, r  # two micro-batches of 8 sequences of 32 tokens
        assert r.fwd_s > 0 and r.bwd_s > 0 and r.opt_s > 0, r
        if strategy == "ddp":  # FSDP2 has no DDP hook (the profiler's window is off here)
            assert r.comm_source == "hook" and r.exposed_comm_s is not None, r
        else:
            assert r.comm_source is None, r
    assert len({r.loss for r in rows if r.step == 10}) == 2  # per rank, not synced
    assert [c["step"] for c in checkpoints][:3] == [9, 19, 29], checkpoints
    assert checkpoints[0]["path"] == str(out / "checkpoints" / "epoch=0-step=10.ckpt")
    config = identity["config"]
    assert (config["accumulate_grad_batches"], config["max_steps"]) == (2, 120), config
    kind = {"ddp": "DDPStrategy", "fsdp2": "ModelParallelStrategy"}[strategy]
    assert (config["strategy"], config["world_size"], config["lr"]) == (kind, 2, 3e-3)
    assert config["shard"] is (strategy == "fsdp2"), config
    assert config["framework"].startswith("lightning 2.")

    # The rollback set global_step back: the steps after the checkpoint ran again on
    # every rank (their first runs, the spike among them, kept as replaced), and the
    # run went on to max_steps with its loss back on trend.
    # Under DDP rank 1 then died as step 75 began, and attempt 2 resumed from last.ckpt
    # (the weights after step 69): steps 70 to 74 ran again on both ranks.
    assert_replaced(replaced, rollback=(ckpt, barrier), died=75 if dies else None)
    assert [a["number"] for a in attempts] == ([1, 2] if dies else [1]), attempts
    if dies:
        assert second["config"]["framework"].startswith("lightning "), second
        assert "Restored all states from the checkpoint at" in said and "last.ckpt" in said
        assert "Restored all states from the checkpoint at" in said and "last.ckpt" in said
    loss = dict(zip(series["step"], series["median"], strict=True))
    assert max(loss) == 119
    before = statistics.median(loss[s] for s in range(25, 35))
    after = statistics.median(loss[s] for s in range(110, 120))
    assert after < 1.1 * before, (before, after)
