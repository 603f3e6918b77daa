"""One rank of an HSDP job on CPU gloo (run by tests/e2e/test_sdc_drill.py).

A 2 x 2 device mesh (dim 0 replicates, dim 1 shards) and ``fully_shard``: ranks 0 and 2
hold one shard of every parameter, 1 and 3 the other. The agent sends to a collector
(``TRAINWARDEN_URL``), checks the replicas every 5 steps and takes its drill from
``TRAINWARDEN_DRILL``.

    python -m tests.e2e.hsdp_worker RUN STEPS
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import trainwarden.agent as tw


def main(run: str, steps: int) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    tw.init(run=run, flush_interval_s=0.2, gpu_interval_s=0, profile_every=0)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # identical initial weights: each shard's replicas start equal
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = tw.watch(model, opt, replica_check_every=5, count_flops=False)
    print(f"rank {rank}: replica group {watch.replica_group}", flush=True)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for step in range(steps):
        with tw.step(step) as s:
            loss = model(torch.randn(8, 16, generator=data)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss(loss)
    tw.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
