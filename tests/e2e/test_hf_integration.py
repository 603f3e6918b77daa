"""Issue 36's proof for the Hugging Face Trainer: ``examples/hf_trainer.py`` (a tiny
GPT-2 from a config, synthetic data) under ``torchrun --nproc-per-node 2`` on CPU with
gloo, against a real ``trainwarden serve``, with ``TrainwardenCallback`` as its only
trainwarden line.

- Both ranks' steps arrive with the per-rank loss on every optimizer step, the gradient
  norm, phases, tokens and DDP's comm split; checkpoints appear; ``attempt_start``
  carries the Trainer's arguments.
- ``loss_spike=200x@step=35``: LossSpike fires, every rank restores the same checkpoint in
  process at the same step, and the run finishes with its loss back on trend.
- ``die@rank=1,step=25`` under ``--max-restarts 1``: the job resumes from its newest
  checkpoint as a second attempt and finishes.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from sqlalchemy import create_engine, text

from ..conftest import Server, start_serve, stop_serve
from .launch import run_example
from .test_drills import wait_for
from .test_rollback_drill import serve_with_rollback

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer.py"


def torchrun(
    server: Server, run: str, out: Path, log: Path, *, drill: str, steps: int, restarts: int = 0
) -> int:
    return run_example(
        EXAMPLE,
        server.url,
        run,
        out,
        log,
        drill=drill,
        steps=steps,
        restarts=restarts,
        env={"TOKENIZERS_PARALLELISM": "false"},
    )


def test_a_trainer_s_steps_arrive_and_a_loss_spike_is_rolled_back(tmp_path: Path) -> None:
    server = serve_with_rollback(f"sqlite:///{tmp_path / 'hf.db'}", tmp_path)
    run, log = "hf-rollback", tmp_path / "torchrun.log"
    try:
        code = torchrun(
            server, run, tmp_path / "out", log, drill="loss_spike=50x@step=35", steps=160
        )
        assert code == 0, log.read_text()[-5000:]
        (action,) = wait_for(
            lambda: [
                a
                for a in server.get("/api/v1/actions", run=run).json()
                if a["state"] in ("done", "failed")
            ],
            30,
            "the rollback done",
        )
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        checkpoints = server.get(f"/api/v1/runs/{run}/checkpoints").json()
        identity = server.get(f"/api/v1/runs/{run}/identity").json()
    finally:
        stop_serve(server)
    assert action["state"] == "done", action
    restored = {r["checkpoint_step"] for r in action["result"]["ranks"].values()}
    barriers = {r["barrier_step"] for r in action["result"]["ranks"].values()}
    assert sorted(action["result"]["ranks"]) == ["0", "1"] and len(restored) == len(barriers) == 1
    (ckpt,) = restored
    assert ckpt in (19, 29), action  # checkpoint-20 or -30: before the spike at 35
    said = log.read_text()
    assert said.count(f"rolled back to {tmp_path / 'out'}/checkpoint-{ckpt + 1}") == 2, said[-3000:]

    engine = create_engine(f"sqlite:///{tmp_path / 'hf.db'}")
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
        assert r.comm_source == "hook" and r.exposed_comm_s is not None, r
    assert {s: {r.loss for r in rows if r.step == s} for s in (10,)}[10].__len__() == 2  # per rank
    assert [c["step"] for c in checkpoints][:3] == [9, 19, 29], checkpoints
    config = identity["config"]
    assert config["gradient_accumulation_steps"] == 2 and config["max_steps"] == 160
    assert config["framework"].startswith("transformers ")

    loss = dict(zip(series["step"], series["median"], strict=True))
    before = statistics.median(loss[s] for s in range(25, 35))
    after = statistics.median(loss[s] for s in sorted(loss)[-10:])
    assert after < 1.1 * before, (before, after)


def test_a_rank_that_dies_resumes_as_a_second_attempt(tmp_path: Path) -> None:
    server = start_serve(f"sqlite:///{tmp_path / 'hf.db'}", tmp_path / "serve.log")
    run, log = "hf-restart", tmp_path / "torchrun.log"
    try:
        code = torchrun(
            server, run, tmp_path / "out", log, drill="die@rank=1,step=25", steps=40, restarts=1
        )
        assert code == 0, log.read_text()[-5000:]
        attempts = wait_for(
            lambda: len(a := server.get(f"/api/v1/runs/{run}/attempts").json()) == 2 and a,
            30,
            "two attempts",
        )
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
    finally:
        stop_serve(server)
    assert [a["number"] for a in attempts] == [1, 2], attempts
    assert max(series["step"]) == 39  # the second attempt went on to the end
    # it resumed from checkpoint-20 (the weights after step 19): step 20 ran twice
    assert min(s for s in series["step"] if s >= 20) == 20
