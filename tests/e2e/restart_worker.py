"""A trainer that resumes from its last checkpoint, for the restart drill under torchrun.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/e2e/restart_worker.py \
        --run-name R --url U --ckpt-dir D --steps 50 --every 10 --die-at 35

Each rank trains a tiny DDP model on gloo, saves a checkpoint every ``--every`` steps
(timed by ``tw.checkpointing``) and, when started again by torchrun, loads the newest
one and goes on from the step after it. The ``die`` drill runs in the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` 0): rank 1 exits without a goodbye at ``--die-at``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import trainwarden.agent as tw
from trainwarden.agent.integrations.common import init_process_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-name", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--die-at", type=int, default=35)
    p.add_argument("--work-ms", type=float, default=40)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--facts", help="a folder: each process writes its own clock's facts there")
    a = p.parse_args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group("gloo")  # under torchrun: a store prefix per restart
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(32, 32))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    ckpts = Path(a.ckpt_dir)
    saved = sorted(ckpts.glob("step-*.pt"), key=lambda f: int(f.stem.split("-")[1]))
    start = 0
    if saved:
        state = torch.load(saved[-1])
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    facts = _Facts(a.facts, rank, restart)
    facts.say("init", t=time.time())
    tw.init(
        run=a.run_name,
        url=a.url,
        flush_interval_s=0.3,
        heartbeat_s=1.0,
        profile_every=0,
        config={"lr": a.lr, "every": a.every, "model": {"dim": 32}},
        tags=["restart-drill"],
        data_snapshot="synthetic-v1",
        drill=f"die@rank=1,step={a.die_at}" if restart == 0 else None,
    )
    for step in range(start, a.steps):
        began = time.time()
        try:
            with tw.step(step, tokens=64) as s:
                x = torch.randn(64, 32)
                loss = (model(x) - x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                time.sleep(a.work_ms / 1000)
                s.loss(loss.detach())
        finally:  # a step that failed (a peer died in its all-reduce) ran too
            facts.say("step", step=step, t0=began, t1=time.time())
        if step % a.every == 0 and step > 0:
            path = ckpts / f"step-{step}.pt"
            with tw.checkpointing(step, path):
                if rank == 0:
                    ckpts.mkdir(parents=True, exist_ok=True)
                    torch.save(
                        {"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step},
                        path,
                    )
                time.sleep(0.05)  # the save's cost, the same on every rank
            dist.barrier()  # every rank sees the file before anyone can die after it
    facts.say("end", t=time.time())
    tw.shutdown()
    del model, opt  # DDP holds the process group: free it first (see comm_worker.py)
    gc.collect()
    dist.destroy_process_group()


class _Facts:
    """The trainer's own log (its clock, its restart count), one JSON line a fact, for the
    test to check the collector's figures against facts it did not compute."""

    def __init__(self, folder: str | None, rank: int, restart: int) -> None:
        self._file = (
            None
            if folder is None
            else open(Path(folder) / f"rank{rank}-restart{restart}.jsonl", "a")  # noqa: SIM115
        )
        self._base = {"rank": rank, "restart": restart}

    def say(self, what: str, **facts: float) -> None:
        if self._file is not None:
            self._file.write(json.dumps({**self._base, "what": what, **facts}) + "\n")
            self._file.flush()


if __name__ == "__main__":
    main()
