"""Issue 36's proof for FSDP2 in the torchtitan style: ``examples/fsdp2_trainer.py``
(``fully_shard`` per block and on the root over a 1-D mesh, a plain ``tw.step`` loop,
``torch.distributed.checkpoint``) under ``torchrun --nproc-per-node 2`` on CPU with gloo,
against a real ``trainwarden serve``.

- Both ranks' steps arrive with their own loss, the gradient norm, phases and tokens; the
  sampled profiler window's steps (``profile_every=10``: steps 9, 19, ...) carry the comm
  split (``comm_source == "profiler"``: FSDP2 has no DDP hook), the others none;
  checkpoints appear; ``attempt_start`` carries the mesh.
- One job, ``loss_spike=50x@step=35;die@rank=1,step=75`` under ``--max-restarts 1``:
  LossSpike fires and the example's own ``tw.on_rollback`` handler restores the same
  checkpoint on every rank at the same step; later rank 1 dies, and the job resumes from
  its newest checkpoint (``step-69``) as a second attempt, numbered on from step 70, and
  finishes with its loss back on trend. (One job for both: a job's start, torch in each
  rank, is most of its CPU.)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from pathlib import Path

from sqlalchemy import create_engine, text

from ..helpers import Server, stop_serve
from .helpers import serve_with_rollback
from .launch import assert_replaced, assert_resumed, finished_action, torchrun, two_attempts

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_trainer.py"


def launch(
    server: Server, run: str, out: Path, log: Path, *, drill: str, steps: int, restarts: int = 0
) -> int:
    """The example under torchrun with 2 ranks (checkpoints every 10 steps, the
    profiler's window every 10), as a user runs it; its output in ``log``."""
    cmd = torchrun(
        2,
        str(EXAMPLE),
        "--output-dir",
        str(out),
        "--steps",
        str(steps),
        "--save-every",
        "10",
        "--profile-every",
        "10",
        "--work-ms",
        "15",  # time for the collector's rollback round trips
        restarts=restarts,
    )
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_URL": server.url,
        "TRAINWARDEN_RUN": run,
        "TRAINWARDEN_DRILL": drill,
        "TRAINWARDEN_FLUSH_INTERVAL": "0.5",
    }
    started = time.monotonic()
    with log.open("w") as out_file:
        code = subprocess.run(
            cmd, stdout=out_file, stderr=subprocess.STDOUT, env=env, timeout=300
        ).returncode
    print(f"torchrun {run}: {time.monotonic() - started:.1f} s")
    return code


def test_fsdp2_steps_with_the_profiler_s_comm_split_a_rollback_and_a_restart(
    tmp_path: Path,
) -> None:
    db = tmp_path / "fsdp2.db"
    server = serve_with_rollback(f"sqlite:///{db}", tmp_path)
    run, log, out = "fsdp2-rollback", tmp_path / "torchrun.log", tmp_path / "out"
    drill = "loss_spike=50x@step=35;die@rank=1,step=75"
    try:
        code = launch(server, run, out, log, drill=drill, steps=110, restarts=1)
        assert code == 0, log.read_text()[-5000:]
        action = finished_action(server, run)
        two_attempts(server, run)
        replaced = server.get(f"/api/v1/runs/{run}/replaced", metric="loss").json()
        second = server.get(f"/api/v1/runs/{run}/identity", attempt=2).json()
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
    (ckpt,), (barrier,) = restored, barriers
    assert ckpt in (19, 29), action  # step-19 or step-29: before the spike at 35
    said = log.read_text()
    assert said.count(f"rolled back to {out / f'step-{ckpt}'} (step {ckpt})") == 2, said[-3000:]
    print(f"both ranks restored step-{ckpt} after step {barrier}")

    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT s.step, s.rank, s.loss, s.grad_norm, s.tokens, s.fwd_s, s.bwd_s, s.opt_s,"
                " s.comm_source, s.compute_s, s.exposed_comm_s, s.overlapped_comm_s"
                " FROM rank_steps s JOIN runs r ON r.id = s.run_id"
                " WHERE r.name = :n AND s.step < 30"
            ),
            {"n": run},
        ).all()
    assert {(r.step, r.rank) for r in rows} == {(n, k) for n in range(30) for k in (0, 1)}
    for r in rows:
        assert r.loss is not None and r.grad_norm is not None, r
        assert r.tokens == 8 * 32, r  # a batch of 8 sequences of 32 tokens
        assert r.fwd_s > 0 and r.bwd_s > 0 and r.opt_s > 0, r
    assert len({r.loss for r in rows if r.step == 10}) == 2  # per rank: each its own batch
    # The profiler's windows: the 10th and 20th step each rank ran (never replayed: the
    # rollback went back to step 19 or later)
    sampled = [r for r in rows if r.step in (9, 19)]
    assert len(sampled) == 4, rows
    for r in sampled:
        assert r.comm_source == "profiler", r
        assert r.compute_s > 0 and r.exposed_comm_s + r.overlapped_comm_s > 0, r
    assert all(r.comm_source is None for r in rows if r.step < 19 and r.step != 9), rows
    comm = {
        r.rank: round((r.exposed_comm_s + r.overlapped_comm_s) * 1000, 1)
        for r in sampled
        if r.step == 19
    }
    print(f"the profiler's comm (ms) on step 19, per rank: {comm}")

    assert [c["step"] for c in checkpoints][:3] == [9, 19, 29], checkpoints
    assert checkpoints[0]["path"] == str(out / "step-9"), checkpoints
    config = identity["config"]
    assert config["mesh"] == {"shape": [2], "dims": ["shard"]}, config
    assert config["framework"].endswith(" fully_shard"), config

    # Rank 1 died as step 75 began: both ranks of the restarted job loaded step-69 (the
    # weights after step 69) and numbered on from step 70. The rollback's steps ran twice
    # in attempt 1, and steps 70 to 74 again in attempt 2: their first runs are replaced.
    assert second["config"]["framework"].endswith(" fully_shard"), second
    for rank in (0, 1):
        line = f"rank {rank}: resumed from {out / 'step-69'} at step 70"
        assert said.count(line) == 1, said[-3000:]
    assert_resumed(db, run, at=70, last=109)
    assert_replaced(replaced, rollback=(ckpt, barrier), died=75)

    loss = dict(zip(series["step"], series["median"], strict=True))
    before = statistics.median(loss[s] for s in range(25, 35))
    after = statistics.median(loss[s] for s in sorted(loss)[-10:])
    assert after < 1.1 * before, (before, after)
