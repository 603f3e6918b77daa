"""Runs with identity, attempts and checkpoints, sent as the agents send them (``POST
/api/v1/ingest``), for the economics views (run page, timelines, post-mortems):

- ``econ``: 2 ranks over the last 5 hours. Attempt 1 starts at ``t0``, saves checkpoints
  at steps 5 and 143 (20 s each, 2.3 h apart) and ends at step 155: rank 1 raises a CUDA
  error, torchrun SIGTERMs rank 0. Attempt 2 starts at 2.7 h, resumes from step 144 and
  saves step 270; it is still running. A step every 60 s (55 s in the step).
- ``other``: the same identity with a learning rate of 1e-3 (the diff names it).
- ``old``: an agent older than run identity: steps only, no ``attempt_start``.

With ``--mtbf-hours 7`` (one interruption is too few for the run's own rate) the advisor
says T* = sqrt(2 x 20 s x 7 h) = 1004 s: 17 min, against 2.4 h now: save more often.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

RUN, OTHER, OLD = "econ", "other", "old"
WORLD = 2
HOUR = 3600.0
STEP_S, IN_STEP_S = 60.0, 55.0
CONFIG = {
    "lr": 3e-4,
    "batch": 512,
    "model": {"layers": 24, "d_model": 2048},
    "optim": {"name": "adamw", "betas": [0.9, 0.95]},
}
MTBF_HOURS = 7.0
PRICE = 2.5

Post = Callable[[dict[str, Any]], None]


HEARTBEAT_S = 0.01


def body(
    run: str,
    rank: int,
    session: str,
    started: float,
    *,
    steps: list[dict[str, Any]] = (),  # type: ignore[assignment]
    events: list[dict[str, Any]] = (),
    world: int = WORLD,
) -> dict[str, Any]:  # type: ignore[assignment]
    """One agent's batch, as :mod:`.read.test_economics` sends it, from a node named like one."""
    out = economics_body(run, rank, session, started, steps=steps, events=events, world=world)
    out["agent"]["host"] = f"gpu-node{rank}"
    out["agent"]["heartbeat_s"] = 3600  # no rank goes "dead" while a test looks at the page
    return out


def start(session: str, t: float, config: dict[str, Any], *, rank: int) -> dict[str, Any]:
    data: dict[str, Any] = {
        "attempt": None,
        "restart_count": None,
        "config": config,
        "tags": ["baseline", "llama-1b"],
        "data_snapshot": "s3://corpus/v7@2026-11-01",
        "code": {
            "commit": "9f8e7d6c5b4a39281706f5e4d3c2b1a098765432",
            "dirty": True,
            "branch": "main",
            "root": "/work/llm",
        },
        "env": {
            "python": "3.11.7",
            "torch": "2.5.1",
            "cuda": "12.4",
            "nccl": "2.21.5",
            "gpu": "NVIDIA H100 80GB HBM3",
            "gpu_count": 1,
            "driver": "550.54.15",
            "host": f"gpu-node{rank}",
            "platform": "Linux-5.15-x86_64",
            "world_size": WORLD,
            "packages_hash": "3b1f" + "0" * 60,
        },
    }
    if rank == 0:
        data["packages"] = ["numpy==2.1.0", "torch==2.5.1"]
    return {"id": f"start-{session}", "kind": "attempt_start", "ts": t, "data": data}


def end(session: str, t: float, reason: str, detail: str, last_step: int) -> dict[str, Any]:
    return {
        "id": f"end-{session}",
        "kind": "attempt_end",
        "ts": t,
        "data": {"reason": reason, "detail": detail, "exit_code": 1, "last_step": last_step},
    }


def steps(first: int, last: int, t_first: float) -> list[dict[str, Any]]:
    return [
        {
            "step": n,
            "ts": t_first + STEP_S * (n - first),
            "duration_s": IN_STEP_S,
            "data_wait_s": STEP_S - IN_STEP_S,
            "loss": 2.0 - n / 1000,
        }
        for n in range(first, last + 1)
    ]


def ckpt(session: str, step: int, ts: float, seconds: float) -> dict[str, Any]:
    return {
        "id": f"ck-{session}-{step}",
        "kind": "checkpoint",
        "ts": ts,
        "step": step,
        "data": {"path": f"s3://ckpt/econ/step-{step}", "seconds": seconds, "bytes": 14.2e9},
    }


def at_step(t_first: float, first: int, step: int) -> float:
    """When ``step`` ended, in an attempt whose step ``first`` started at ``t_first``."""
    return t_first + STEP_S * (step - first) + IN_STEP_S


def seed(post: Post, now: float | None = None) -> float:
    """Sends the three runs; returns ``t0``, when ``econ`` began."""
    now = time.time() if now is None else now
    t0 = now - 5 * HOUR
    first1 = t0 + 120
    for rank in (0, 1):
        s = f"a{rank}"
        post(body(RUN, rank, s, t0, events=[start(s, t0, CONFIG, rank=rank)]))
        saves = [
            ckpt(s, 5, at_step(first1, 0, 5) + 1, 18.0),
            ckpt(s, 143, at_step(first1, 0, 143) + 1, 22.0),
        ]
        post(body(RUN, rank, s, t0, steps=steps(0, 155, first1), events=saves))
    crash = at_step(first1, 0, 155)
    post(
        body(
            RUN,
            1,
            "a1",
            t0,
            events=[
                end(
                    "a1",
                    crash + 1,
                    "exception",
                    "RuntimeError: CUDA error: an illegal memory access was encountered",
                    155,
                )
            ],
        )
    )
    post(
        body(
            RUN,
            0,
            "a0",
            t0,
            events=[end("a0", crash + 15, "sigterm", "SIGTERM from torchrun", 155)],
        )
    )
    t1 = t0 + 2.7 * HOUR
    first2 = t1 + 240
    last2 = 144 + int((now - 60 - first2) // STEP_S)
    for rank in (0, 1):
        s = f"b{rank}"
        post(body(RUN, rank, s, t1, events=[start(s, t1, CONFIG, rank=rank)]))
        post(
            body(
                RUN,
                rank,
                s,
                t1,
                steps=steps(144, last2, first2),
                events=[ckpt(s, 270, at_step(first2, 144, 270) + 1, 20.0)],
            )
        )
    t2 = now - 600
    for rank in (0, 1):
        s = f"o{rank}"
        post(
            body(
                OTHER,
                rank,
                s,
                t2,
                events=[start(s, t2, {**CONFIG, "lr": 1e-3}, rank=rank)],
                steps=steps(0, 5, t2 + 10),
            )
        )
    post(body(OLD, 0, "old0", t2, steps=steps(0, 5, t2 + 10), world=1))
    return t0


def economics_body(
    run: str,
    rank: int,
    session: str,
    started: float,
    *,
    steps: list[dict[str, Any]] = (),  # type: ignore[assignment]
    events: list[dict[str, Any]] = (),
    world: int = 2,
) -> dict[str, Any]:  # type: ignore[assignment]
    last = steps[-1] if steps else None
    return {
        "run": run,
        "agent": {
            "rank": rank,
            "world_size": world,
            "local_rank": rank,
            "host": f"host{rank}",
            "pid": 100 + rank,
            "session": session,
            "started_at": started,
            # Short: the tests replay an attempt's life in a moment, and a process silent
            # past 3 of these is gone (a restart, not a second live process: claims.py).
            "heartbeat_s": HEARTBEAT_S,
            "last_step": None if last is None else last["step"],
            "last_step_end": None if last is None else last["ts"] + last["duration_s"],
        },
        "steps": list(steps),
        "events": list(events),
    }
