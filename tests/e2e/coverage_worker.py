"""A trainer on a map-style dataset of 10,000 samples whose sampler, in its buggy
epochs, repeats 1 % of the samples and drops 1 % (issue 35's coverage proof). Run under
``torchrun --nproc-per-node 4``: each rank trains a tiny DDP model on its share, through
``tw.watch_loader`` (the trainer never passes ids)."""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

import trainwarden.agent as tw

SIZE = 10_000


class Points(Dataset):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([i % 7, i % 11, i % 13, 1.0]) / 13
        return x, x.sum(0, keepdim=True)


class BuggySampler(Sampler[int]):
    """A distributed sampler (a seeded shuffle per epoch, every world-th index for this
    rank) that, in a buggy epoch, replaces every 100th position of the shuffle (50, 150,
    ...) by the index before it: 100 samples trained twice, 100 never."""

    def __init__(self, rank: int, world: int, buggy: set[int]) -> None:
        self.rank, self.world, self.buggy, self.epoch = rank, world, buggy, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        order = torch.randperm(SIZE, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        if self.epoch in self.buggy:
            for p in range(50, SIZE, 100):
                order[p] = order[p - 1]
        return order[self.rank :: self.world]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._order())

    def __len__(self) -> int:
        return len(range(self.rank, SIZE, self.world))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-name", required=True)
    p.add_argument("--url", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--buggy", type=int, nargs="*", default=[0])
    p.add_argument("--work-ms", type=float, default=0)
    a = p.parse_args()
    tw.init(run=a.run_name, url=a.url, flush_interval_s=0.5, profile_every=0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tw.watch(model, opt)
    sampler = BuggySampler(rank, world, set(a.buggy))
    loader = tw.watch_loader(DataLoader(Points(), batch_size=25, sampler=sampler))
    step = 0
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            with tw.step(step, tokens=len(x)) as s:
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                s.loss(loss)
                if a.work_ms:
                    time.sleep(a.work_ms / 1000)
            step += 1
        print(f"rank {rank} ended epoch {epoch} at step {step - 1}", flush=True)
    tw.shutdown()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
