"""Issue 36's proof for Accelerate: ``examples/accelerate_trainer.py`` (a tiny causal
transformer built in code, synthetic data, ``accelerator.accumulate`` with 2
micro-batches) under ``torchrun --nproc-per-node 2`` on CPU with gloo, against a real
``trainwarden serve``, with ``TrainwardenTracker`` and ``tracker.watch`` as its
trainwarden lines.

- Both ranks' steps arrive with the per-rank loss on every optimizer step, the gradient
  norm, phases, tokens and DDP's comm split; checkpoints (``accelerator.save_state``)
  appear; ``attempt_start`` carries the ``init_trackers`` config and the framework.
- One job, ``loss_spike=50x@step=35;die@rank=1,step=75`` under ``--max-restarts 1``:
  LossSpike fires and every rank restores the same checkpoint in process
  (``accelerator.load_state``) at the same step; later rank 1 dies, and the job resumes
  from its newest checkpoint as a second attempt, its steps numbered on from that
  checkpoint's, and finishes with its loss back on trend. (One job for both: a job's
  start, torch and Accelerate in each rank, is most of its CPU.)
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from ..helpers import Server, stop_serve
from .helpers import serve_with_rollback
from .launch import assert_resumed, finished_action, rank_steps, run_example, two_attempts

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_trainer.py"


def torchrun(
    server: Server, run: str, out: Path, log: Path, *, drill: str, steps: int, restarts: int = 0
) -> int:
    started = time.monotonic()
    code = run_example(
        EXAMPLE,
        server.url,
        run,
        out,
        log,
        drill=drill,
        steps=steps,
        restarts=restarts,
        timeout_s=300,
    )
    print(f"torchrun {run}: {time.monotonic() - started:.1f} s")
    return code


def test_steps_arrive_a_loss_spike_is_rolled_back_and_a_dead_rank_resumes_as_attempt_2(
    tmp_path: Path,
) -> None:
    db = tmp_path / "acc.db"
    server = serve_with_rollback(f"sqlite:///{db}", tmp_path)
    run, log, out = "acc-rollback", tmp_path / "torchrun.log", tmp_path / "out"
    drill = "loss_spike=50x@step=35;die@rank=1,step=75"
    try:
        code = torchrun(server, run, out, log, drill=drill, steps=120, restarts=1)
        assert code == 0, log.read_text()[-5000:]
        action = finished_action(server, run)
        two_attempts(server, run)
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        checkpoints = server.get(f"/api/v1/runs/{run}/checkpoints").json()
        identity = server.get(f"/api/v1/runs/{run}/identity").json()
    finally:
        stop_serve(server)
    assert action["state"] == "done", action
    ranks = action["result"]["ranks"]
    restored = {r["checkpoint_step"] for r in ranks.values()}
    barriers = {r["barrier_step"] for r in ranks.values()}
    assert sorted(ranks) == ["0", "1"] and len(restored) == len(barriers) == 1, action
    (ckpt,) = restored
    assert ckpt in (19, 29), action  # step_20 or step_30: before the spike at 35
    folders = {c["step"]: c["path"] for c in checkpoints}
    said = log.read_text()
    assert said.count(f"rolled back to {folders[ckpt]} (step {ckpt})") == 2, said[-3000:]
    print(f"both ranks restored {folders[ckpt]} after step {barriers.pop()}")

    rows = rank_steps(db, run, 30)
    assert {(r.step, r.rank) for r in rows} == {(n, k) for n in range(30) for k in (0, 1)}
    for r in rows:  # every optimizer step of each rank, its own loss
        assert r.loss is not None and r.grad_norm is not None, r
        assert r.tokens == 2 * 8 * 32, r  # two micro-batches of 8 sequences of 32 tokens
        assert r.fwd_s > 0 and r.bwd_s > 0 and r.opt_s > 0, r
        assert r.comm_source == "hook" and r.exposed_comm_s is not None, r
    assert len({r.loss for r in rows if r.step == 10}) == 2  # per rank: each its own batches
    assert all(r.lr is not None and r.lr > 0 for r in rows), rows  # the built-in lr
    metrics = {(r.step, r.rank): json.loads(r.metrics or "{}") for r in rows}
    # accelerator.log every 10 updates reaches the tracker on rank 1 too (Accelerate calls
    # trackers on the main process only): steps 9 and 19, never run again
    for key in [(9, 0), (9, 1), (19, 0), (19, 1)]:
        assert "train.loss" in metrics[key], (key, metrics[key])
    # save_state every 10 optimizer steps: step_N holds the weights after step N - 1
    assert [c["step"] for c in checkpoints][:3] == [9, 19, 29], checkpoints
    # step_N holds the weights after step N - 1 after the rollback too: the example's own
    # count goes back with it (its tw.on_rollback handler)
    for c in checkpoints:
        assert c["path"] == str(out / f"step_{c['step'] + 1}"), checkpoints
    config = identity["config"]
    assert config["accumulation"] == 2 and config["steps"] == 120, config
    assert config["framework"].startswith("accelerate "), config
    assert config["accelerate"]["num_processes"] == 2, config

    # Rank 1 died as step 75 began: attempt 2 resumed from step_70 (the weights after
    # step 69, its trainwarden.json) and numbered on from step 70, to the end.
    assert said.count(f"resumed from {out / 'step_70'}") == 1, said[-3000:]
    assert_resumed(db, run, at=70, last=119)

    loss = dict(zip(series["step"], series["median"], strict=True))
    before = statistics.median(loss[s] for s in range(25, 35))
    after = statistics.median(loss[s] for s in sorted(loss)[-10:])
    assert after < 1.1 * before, (before, after)
