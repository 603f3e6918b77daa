"""A user's DDP job in the PyTorch tutorial's shape: ``torch.multiprocessing.spawn`` starts
the ranks, each calls ``init_process_group(rank=r, world_size=n)``; no ``RANK`` in the
environment. The trainwarden lines are the ones docs/agent.md asks for (``tw.init``
first, ``tw.step``, ``s.loss``, ``tw.shutdown``); ``TRAINWARDEN_*`` variables carry the
collector, the run and any drill. Each rank writes the losses it saw to
``<out>/losses-<rank>.json``, for the test to compare with what was stored.

    python spawn_ddp.py OUT --port P [--ranks 2] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import trainwarden.agent as tw  # trainwarden


def train(rank: int, world: int, out: str, port: int, steps: int) -> None:
    tw.init()  # trainwarden: first, before the process group (the Flight Recorder)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = {}
    for step in range(steps):
        with tw.step(step) as s:  # trainwarden
            x = torch.randn(32, 16)
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            s.loss(loss)  # trainwarden
        losses[step] = loss.item()
    Path(out, f"losses-{rank}.json").write_text(json.dumps(losses))
    tw.shutdown()  # trainwarden
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    mp.spawn(train, args=(a.ranks, a.out, a.port, a.steps), nprocs=a.ranks)
