"""A small DDP trainer instrumented with the agent, used by ``trainwarden demo`` and the tests.

Run one process per rank with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set (torchrun or srun do this), e.g.::

    torchrun --nproc-per-node 2 -m trainwarden.agent.demo_trainer --run-name demo --url http://127.0.0.1:8000

The model learns the next token of sequences drawn from a fixed Markov chain, so the
loss falls from ln(vocab) towards the chain's entropy. Each rank samples its own
sequences, so ranks report different losses, as in real data-parallel training.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trainwarden.agent as tw


class TinyLM(nn.Module):
    def __init__(self, vocab: int, context: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(
            nn.Flatten(), nn.Linear(context * dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, vocab)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(tokens))


class MarkovData:
    """Sequences from one transition matrix shared by all ranks; samples differ per rank."""

    def __init__(self, vocab: int, context: int, *, chain_seed: int, sample_seed: int) -> None:
        chain = torch.Generator().manual_seed(chain_seed)
        self.transitions = torch.softmax(torch.randn(vocab, vocab, generator=chain) * 2.5, dim=-1)
        self.rng = torch.Generator().manual_seed(sample_seed)
        self.vocab = vocab
        self.context = context

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = torch.empty(size, self.context + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (size,), generator=self.rng)
        for i in range(1, self.context + 1):
            seq[:, i] = torch.multinomial(
                self.transitions[seq[:, i - 1]], 1, generator=self.rng
            ).squeeze(1)
        return seq[:, :-1], seq[:, -1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-name", dest="run", default=os.environ.get("TRAINWARDEN_RUN", "demo"))
    p.add_argument("--url", default=os.environ.get("TRAINWARDEN_URL"))
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--start-step", type=int, default=0, help="first step number (a resumed run)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--data-delay", type=float, default=0.0, help="seconds the 'loader' takes per batch"
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--work-ms",
        type=float,
        default=0.0,
        help="extra time each step waits after its forward, as if on a device (steadier timing "
        "when many ranks share few CPU cores)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0

    vocab, context = 64, 8
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model: nn.Module = TinyLM(vocab, context, dim=32)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = MarkovData(vocab, context, chain_seed=args.seed, sample_seed=args.seed + 1 + rank)

    tw.init(run=args.run, url=args.url)
    tw.watch(model, opt, grad_norm=True)  # phases, comm split (DDP), MFU, grad-norm spikes
    for step in range(args.start_step, args.start_step + args.steps):
        if args.data_delay:
            time.sleep(args.data_delay)  # shows up as data wait: the gap between steps
        x, y = data.batch(args.batch_size)
        with tw.step(step, tokens=x.numel()) as s:
            loss = F.cross_entropy(model(x), y)
            if args.work_ms:
                time.sleep(args.work_ms / 1000)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.loss(loss)
    tw.shutdown()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
