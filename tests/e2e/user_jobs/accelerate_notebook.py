"""A user's Accelerate loop started by ``accelerate.notebook_launcher`` (as from a
notebook: the launcher forks the ranks itself, no torchrun), on CPU. The trainwarden
lines are the tracker's, as docs/integrations.md shows them; ``TRAINWARDEN_URL`` names
the collector. Each rank writes the losses it saw to ``<out>/losses-<rank>.json``.

    python accelerate_notebook.py OUT RUN [--steps 30]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator, notebook_launcher
from torch import nn

from trainwarden.agent.integrations.accelerate import TrainwardenTracker  # trainwarden


def train(out: str, run: str, steps: int) -> None:
    tracker = TrainwardenTracker(run)  # trainwarden
    accelerator = Accelerator(cpu=True, log_with=[tracker])  # trainwarden: log_with
    torch.manual_seed(accelerator.process_index)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(torch.randn(4096, 16), batch_size=32)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    accelerator.init_trackers(run)
    tracker.watch(accelerator, model, optimizer)  # trainwarden
    losses = {}
    for step, batch in enumerate(data):
        if step == steps:
            break
        loss = ((model(batch) - batch.sum(1, keepdim=True)) ** 2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses[step] = loss.item()
    Path(out, f"losses-{accelerator.process_index}.json").write_text(json.dumps(losses))
    accelerator.end_training()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("run")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    notebook_launcher(train, (a.out, a.run, a.steps), num_processes=2)
