"""A PyTorch Lightning Trainer observed by trainwarden: a tiny transformer built in code
(no download) learns a synthetic language (each token follows from the one before
with a fixed table, plus noise), on CPU or GPU, one process or many under torchrun.

    pip install 'trainwarden[lightning]'
    trainwarden serve &                                   # the collector, on :8000
    TRAINWARDEN_URL=http://127.0.0.1:8000 TRAINWARDEN_TOKEN=... \\
        torchrun --nproc-per-node 2 examples/lightning_trainer.py --output-dir /tmp/pl-run

The two lines that matter are marked ``# trainwarden``. A restarted job (torchrun
``--max-restarts``, a Slurm requeue) resumes from the newest checkpoint
(``ckpt_path="last"``, which ``save_last`` keeps pointing at it). ``--strategy fsdp2``
shards the model with ``fully_shard`` (Lightning's ``ModelParallelStrategy``) instead of
DDP: its checkpoints are distributed-checkpoint folders.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.nn import functional as F

from trainwarden.agent.integrations.common import init_process_group
from trainwarden.agent.integrations.lightning import TrainwardenCallback  # trainwarden

VOCAB, LENGTH = 64, 32


class Synthetic(torch.utils.data.Dataset):
    """Sequences where token t+1 = (5 * token t + 3) mod VOCAB, with 10 % noise."""

    def __init__(self, size: int, seed: int = 0, length: int = LENGTH) -> None:
        g = torch.Generator().manual_seed(seed)
        first = torch.randint(0, VOCAB, (size, 1), generator=g)
        rows = [first]
        for _ in range(length - 1):
            nxt = (rows[-1] * 5 + 3) % VOCAB
            noise = torch.rand(size, 1, generator=g) < 0.1
            rows.append(torch.where(noise, torch.randint(0, VOCAB, (size, 1), generator=g), nxt))
        self.ids = torch.cat(rows, dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class TinyLM(L.LightningModule):
    """A causal transformer of two pre-norm layers: next-token prediction."""

    def __init__(
        self,
        vocab: int = VOCAB,
        width: int = 64,
        layers: int = 2,
        lr: float = 3e-3,
        work_ms: float = 0.0,
        shard: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lr, self.work_ms, self.shard = lr, work_ms, shard
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(LENGTH, width))
        block = nn.TransformerEncoderLayer(
            width,
            nhead=4,
            dim_feedforward=4 * width,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.work_ms:  # a bigger model's time
            time.sleep(self.work_ms / 1000)
        n = ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        return self.head(self.blocks(self.embed(ids) + self.pos[:n], mask=causal, is_causal=True))

    def configure_model(self) -> None:
        """FSDP2 (``--strategy fsdp2``): each block, then the root, sharded over the data
        parallel dimension of the mesh ``ModelParallelStrategy`` made."""
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        self.log("train_loss", loss)  # Lightning's own logging, every log_every_n_steps
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--strategy", choices=("ddp", "fsdp2"), default="ddp")
    p.add_argument(
        "--work-ms", type=float, default=0, help="extra time a forward takes (a bigger model)"
    )
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        # Before the Trainer (which then uses it): a process group that survives
        # torchrun's restarts.
        init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    strategy: Any = "ddp" if world > 1 else "auto"
    if a.strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        # every rank a data-parallel shard (its default puts a node's devices in the
        # tensor-parallel dimension: the ranks would share their batches)
        strategy = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(
        Synthetic(8192), batch_size=a.batch_size, shuffle=True, num_workers=0
    )
    trainer = L.Trainer(
        default_root_dir=a.output_dir,  # its name is the run's, unless TRAINWARDEN_RUN says
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        strategy=strategy,
        max_steps=a.steps,
        accumulate_grad_batches=a.accumulation,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=os.path.join(a.output_dir, "checkpoints"),
                every_n_train_steps=a.save_steps,
                save_top_k=-1,  # keep them: a rollback restores one of them
                save_last="link",  # last.ckpt points at the newest
            ),
            TrainwardenCallback(),  # trainwarden
        ],
    )
    model = TinyLM(work_ms=a.work_ms, shard=a.strategy == "fsdp2")
    trainer.fit(model, loader, ckpt_path="last")  # a restarted job resumes


if __name__ == "__main__":
    main()
