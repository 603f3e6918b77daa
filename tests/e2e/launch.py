"""Launching trainers as a user would: torchrun's command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..helpers import Server, wait_for


def torchrun(nproc: int, *target: str, restarts: int = 0) -> list[str]:
    """``torchrun --standalone --nproc-per-node N [--max-restarts R] <target...>``: a
    script path, or ``-m module``, and its arguments."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.2",
        *target,
    ]


def demo_job(nproc: int, run: str, url: str, *args: str, restarts: int = 0) -> list[str]:
    """The demo trainer under torchrun (``torchrun``'s command line) for run ``run``,
    sending to ``url``; ``args``: more of the trainer's own."""
    return torchrun(
        nproc,
        "-m",
        "trainwarden.agent.demo_trainer",
        "--run-name",
        run,
        "--url",
        url,
        *args,
        restarts=restarts,
    )


def run_example(
    example: Path,
    server_url: str,
    run: str,
    out: Path,
    log: Path,
    *,
    drill: str,
    steps: int,
    restarts: int = 0,
    env: dict[str, str] | None = None,
    timeout_s: float = 420,
    args: tuple[str, ...] = (),
    launcher: list[str] | None = None,
) -> int:
    """One of ``examples/``'s trainers under torchrun with 2 ranks, as a user runs it (the
    collector's URL and the run's name in the environment), with a fault ``drill``; its
    output in ``log``; returns torchrun's exit code. ``args``: more of the example's own;
    ``launcher``: another launcher's command line for 2 ranks, the example after it."""
    script = [
        str(example),
        "--output-dir",
        str(out),
        "--steps",
        str(steps),
        "--save-steps",
        "10",
        "--work-ms",
        "15",  # 40-50 ms steps: time for the collector's rollback round trips
        *args,
    ]
    cmd = [*launcher, *script] if launcher else torchrun(2, *script, restarts=restarts)
    environ = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_URL": server_url,
        "TRAINWARDEN_RUN": run,
        "TRAINWARDEN_DRILL": drill,
        "TRAINWARDEN_FLUSH_INTERVAL": "0.5",
        "TRAINWARDEN_PROFILE_EVERY": "0",
        **(env or {}),
    }
    with log.open("w") as out_file:
        return subprocess.run(
            cmd, stdout=out_file, stderr=subprocess.STDOUT, env=environ, timeout=timeout_s
        ).returncode


def assert_resumed(db: Path, run: str, *, at: int, last: int) -> None:
    """A two-rank job's second attempt resumed from a checkpoint: each rank's first
    attempt numbered its steps from 0, the second from ``at`` (the step after the
    checkpoint's) to ``last`` (read from the collector's SQLite database ``db``)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT a.attempt, a.rank, a.first_step, a.last_step FROM attempt_sessions a"
                " JOIN runs r ON r.id = a.run_id WHERE r.name = :n ORDER BY a.attempt, a.rank"
            ),
            {"n": run},
        ).all()
    print(f"(attempt, rank, first step, last step): {[tuple(r) for r in rows]}")
    firsts = [(r.attempt, r.rank, r.first_step) for r in rows]
    assert firsts == [(1, 0, 0), (1, 1, 0), (2, 0, at), (2, 1, at)], rows
    assert [r.last_step for r in rows if r.attempt == 2] == [last, last], rows


def assert_replaced(
    replaced: dict[str, list[int]], *, rollback: tuple[int, int], died: int | None = None
) -> None:
    """The first runs of the steps that ran twice, kept as replaced (``/replaced``), in a
    job whose rollback restored the checkpoint of step ``rollback[0]`` after step
    ``rollback[1]`` (its barrier): the steps from the checkpoint's next to the barrier. If
    rank 1 then ``died`` as that step began, and the job resumed from the checkpoint of
    step ``died - 6`` (saved every 10 steps: a death at 75 resumes after 69), those steps
    to the death too: the other rank's step at the death, which its collective ended, may
    be there as well (with no loss, or one)."""
    ckpt, barrier = rollback
    steps = replaced["step"]
    losses = dict(zip(steps, replaced["n"], strict=True))  # the ranks' losses a step
    assert {n for s, n in losses.items() if s != died} == {2}, replaced
    assert steps[: barrier - ckpt] == list(range(ckpt + 1, barrier + 1)), replaced
    restarted = [s for s in steps if s > barrier]
    if died is None:
        assert restarted == [], replaced
        return
    resumed = died - died % 10
    assert restarted in (list(range(resumed, died)), list(range(resumed, died + 1))), replaced


def two_attempts(server: Server, run: str) -> list[dict[str, Any]]:
    """The run's attempts once the collector knows two (within 30 s): numbered 1 and 2."""
    attempts = wait_for(
        lambda: len(a := server.get(f"/api/v1/runs/{run}/attempts").json()) == 2 and a,
        30,
        "two attempts",
    )
    assert [a["number"] for a in attempts] == [1, 2], attempts
    return attempts


def finished_action(server: Server, run: str) -> dict[str, Any]:
    """The run's one action once it is done or failed (within 30 s)."""
    (action,) = wait_for(
        lambda: [
            a
            for a in server.get("/api/v1/actions", run=run).json()
            if a["state"] in ("done", "failed")
        ],
        30,
        "the action done or failed",
    )
    return action


def rank_steps(db: Path, run: str, below: int) -> list[Any]:
    """The run's steps below ``below`` in the collector's SQLite database ``db``, one row a
    rank and step (its latest execution), with what the integrations' tests check."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT s.step, s.rank, s.loss, s.grad_norm, s.tokens, s.fwd_s, s.bwd_s,"
                    " s.opt_s, s.comm_source, s.exposed_comm_s, s.overlapped_comm_s, s.lr,"
                    " s.metrics"
                    " FROM rank_steps s JOIN runs r ON r.id = s.run_id"
                    " WHERE r.name = :n AND s.step < :below"
                ),
                {"n": run, "below": below},
            ).all()
        )
