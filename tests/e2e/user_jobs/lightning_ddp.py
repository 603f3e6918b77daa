"""A user's Lightning job started as ``python lightning_ddp.py OUT``: ``Trainer(devices=2,
strategy="ddp")`` on CPU, Lightning's own launcher starts the second process (no
torchrun, no ``RANK``). The one trainwarden line is the callback; ``TRAINWARDEN_URL``
and ``TRAINWARDEN_RUN`` name the collector and the run. Each rank writes the losses its
``training_step`` returned to ``<out>/losses-<rank>.json``.

    python lightning_ddp.py OUT [--steps 30]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from torch import nn

from trainwarden.agent.integrations.lightning import TrainwardenCallback  # trainwarden


class Regression(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 1)
        self.out = out
        self.losses: dict[int, float] = {}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = ((self.layer(batch) - batch.sum(1, keepdim=True)) ** 2).mean()
        self.losses[self.global_step] = loss.item()
        return loss

    def on_train_end(self) -> None:
        Path(self.out, f"losses-{self.global_rank}.json").write_text(json.dumps(self.losses))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.randn(4096, 16), batch_size=32)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=a.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[TrainwardenCallback()],  # trainwarden
    )
    trainer.fit(Regression(a.out), data)
