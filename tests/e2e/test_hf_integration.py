"""Issue 36's proof for the Hugging Face Trainer: ``examples/hf_trainer.py`` (a tiny
GPT-2 from a config, synthetic data) under ``torchrun --nproc-per-node 2`` on CPU with
gloo, against a real ``trainwarden serve``, with ``TrainwardenCallback`` as its only
trainwarden line.

- Both ranks' steps arrive with the per-rank loss on every optimizer step, the gradient
  norm, the learning rate (the one the Trainer logs), phases, tokens and DDP's comm
  split; checkpoints appear; ``attempt_start`` carries the Trainer's arguments.
- One job, ``loss_spike=50x@step=35;die@rank=1,step=33,nth=2`` under
  ``--max-restarts 1``: LossSpike fires and every rank restores the same checkpoint in
  process at the same step. While the steps after it run again, rank 1 dies (as step 33
  begins the second time), and the Trainer's own resume (``get_last_checkpoint``) loads
  its newest checkpoint, one saved after the spike that the rollback had undone: the
  collector finds it from the second attempt's first step,
  ResumedFromSuspectCheckpoint fires, and a second rollback restores the same clean
  checkpoint as the first; the job finishes with its loss back on trend. (One job for
  all of it: a job's start, torch and transformers in each rank, is most of its CPU.)
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from ..helpers import Server, stop_serve, wait_for
from .helpers import serve_with_rollback
from .launch import assert_resumed, run_example, two_attempts

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


def test_steps_arrive_a_loss_spike_is_rolled_back_and_a_dead_rank_resumes_as_attempt_2(
    tmp_path: Path,
) -> None:
    server = serve_with_rollback(f"sqlite:///{tmp_path / 'hf.db'}", tmp_path)
    run, log, steps = "hf-rollback", tmp_path / "torchrun.log", 120
    try:
        code = torchrun(
            server,
            run,
            tmp_path / "out",
            log,
            drill="loss_spike=50x@step=35;die@rank=1,step=33,nth=2",
            steps=steps,
            restarts=1,
        )
        assert code == 0, log.read_text()[-5000:]
        action, again = wait_for(
            lambda: (
                len(
                    done := [
                        a
                        for a in server.get("/api/v1/actions", run=run).json()
                        if a["state"] in ("done", "failed")
                    ]
                )
                == 2
                and sorted(done, key=lambda a: a["id"])
            ),
            30,
            "two rollbacks done or failed",
        )
        two_attempts(server, run)
        (resumed,) = server.get(
            f"/api/v1/runs/{run}/events", kind="resumed_suspect_checkpoint"
        ).json()
        fired = [
            a
            for a in server.get("/api/v1/alerts", run=run).json()
            if a["rule"] == "ResumedFromSuspectCheckpoint"
        ]
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        replaced = server.get(f"/api/v1/runs/{run}/replaced", metric="loss").json()
        checkpoints = server.get(f"/api/v1/runs/{run}/checkpoints").json()
        identity = server.get(f"/api/v1/runs/{run}/identity").json()
    finally:
        stop_serve(server)
    assert action["state"] == "done", action
    restored = {r["checkpoint_step"] for r in action["result"]["ranks"].values()}
    barriers = {r["barrier_step"] for r in action["result"]["ranks"].values()}
    assert sorted(action["result"]["ranks"]) == ["0", "1"] and len(restored) == len(barriers) == 1
    (ckpt,), (barrier,) = restored, barriers
    assert ckpt in (19, 29), action  # checkpoint-20 or -30: before the spike at 35
    said = log.read_text()
    # The restart loaded its newest checkpoint, one saved after the spike: said, paged,
    # and rolled back to the same clean checkpoint.
    first = resumed["step"]
    assert resumed["data"]["checkpoint_step"] == first - 1 and first - 1 > 35, resumed
    assert resumed["data"]["path"] == f"{tmp_path / 'out'}/checkpoint-{first}", resumed
    assert resumed["data"]["good_step"] == ckpt, resumed
    assert [(a["fired_at"] is not None, a["step"]) for a in fired] == [(True, first)], fired
    assert again["trigger"] == "rule:ResumedFromSuspectCheckpoint", again
    assert again["state"] == "done", again
    assert {r["checkpoint_step"] for r in again["result"]["ranks"].values()} == {ckpt}, again
    assert said.count(f"rolled back to {tmp_path / 'out'}/checkpoint-{ckpt + 1}") == 4, said[-3000:]
    # The first rollback's check of the steps run again ended with its processes (the
    # launcher's teardown, or the restart, whichever the collector saw first).
    assert action["result"]["check"].startswith("not checked: "), action

    engine = create_engine(f"sqlite:///{tmp_path / 'hf.db'}")
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT s.step, s.rank, s.loss, s.grad_norm, s.tokens, s.fwd_s, s.bwd_s, s.opt_s,"
                " s.comm_source, s.exposed_comm_s, s.lr FROM rank_steps s"
                " JOIN runs r ON r.id = s.run_id WHERE r.name = :n"
            ),
            {"n": run},
        ).all()
    lr = {(r.step, r.rank): r.lr for r in rows}
    last = max(r.step for r in rows)
    rows = [r for r in rows if r.step < 30]
    assert {(r.step, r.rank) for r in rows} == {(n, k) for n in range(30) for k in (0, 1)}
    # The learning rate each update used, as the Trainer logs it (every 10 updates: its
    # step N is trainwarden's N - 1); steps 9 and 19 never ran again. (The Trainer ends
    # when its data loader does: the rollback's steps are not made up at the end.)
    newest = max(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    history = json.loads(
        (tmp_path / "out" / f"checkpoint-{newest}" / "trainer_state.json").read_text()
    )
    logged = {h["step"] - 1: h["learning_rate"] for h in history["log_history"] if "loss" in h}
    for step in (9, 19, max(logged)):
        assert lr[step, 0] == lr[step, 1] == pytest.approx(logged[step], rel=1e-9), step
    assert {lr[r.step, r.rank] for r in rows} == {3e-3}  # constant until the rollback
    for r in rows:  # every optimizer step of each rank, its own loss
        assert r.loss is not None and r.grad_norm is not None, r
        assert r.tokens == 2 * 8 * 32, r  # two micro-batches of 8 sequences of 32 tokens
        assert r.fwd_s > 0 and r.bwd_s > 0 and r.opt_s > 0, r
        assert r.comm_source == "hook" and r.exposed_comm_s is not None, r
    assert len({r.loss for r in rows if r.step == 10}) == 2  # per rank, not synced
    assert [c["step"] for c in checkpoints][:3] == [9, 19, 29], checkpoints
    config = identity["config"]
    assert config["gradient_accumulation_steps"] == 2 and config["max_steps"] == steps
    assert config["framework"].startswith("transformers ")

    # The second attempt numbered its steps on from the checkpoint it loaded, to the end.
    assert_resumed(tmp_path / "hf.db", run, at=first, last=last)
    assert barrier >= first - 1, (barrier, first)  # saved before the first rollback
    assert replaced["step"][: barrier - ckpt] == list(range(ckpt + 1, barrier + 1)), replaced

    loss = dict(zip(series["step"], series["median"], strict=True))
    before = statistics.median(loss[s] for s in range(25, 35))
    after = statistics.median(loss[s] for s in sorted(loss)[-10:])
    assert after < 1.1 * before, (before, after)
