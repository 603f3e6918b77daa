"""An Accelerate training loop observed by trainwarden: a tiny causal transformer built in
code (no download) learns a synthetic language (each token follows from the one before
with a fixed table, plus noise), on CPU or GPU, one process or many under torchrun.

    pip install 'trainwarden[accelerate]'
    trainwarden serve &                                   # the collector, on :8000
    TRAINWARDEN_URL=http://127.0.0.1:8000 TRAINWARDEN_TOKEN=... \\
        torchrun --nproc-per-node 2 examples/accelerate_trainer.py --output-dir /tmp/acc-run

The lines that matter are marked ``# trainwarden``. A restarted job (torchrun
``--max-restarts``, a Slurm requeue) resumes from the newest ``step_N`` checkpoint in the
output directory, saved with ``accelerator.save_state``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import trainwarden.agent as tw  # trainwarden
from trainwarden.agent.integrations.accelerate import TrainwardenTracker  # trainwarden
from trainwarden.agent.integrations.common import init_process_group

VOCAB, LENGTH = 64, 32


class Synthetic(torch.utils.data.Dataset):
    """Sequences where token t+1 = (5 * token t + 3) mod VOCAB, with 10 % noise."""

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        rows = [torch.randint(0, VOCAB, (size, 1), generator=g)]
        for _ in range(LENGTH - 1):
            nxt = (rows[-1] * 5 + 3) % VOCAB
            noise = torch.rand(size, 1, generator=g) < 0.1
            rows.append(torch.where(noise, torch.randint(0, VOCAB, (size, 1), generator=g), nxt))
        self.ids = torch.cat(rows, dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


class TinyLM(nn.Module):
    """Token and position embeddings, two causal transformer blocks, a head."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(LENGTH, dim))
        block = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = input_ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=input_ids.device)
        x = self.embed(input_ids) + self.pos[:n]
        return self.head(self.blocks(x, mask=mask, is_causal=True))


def newest_checkpoint(folder: Path) -> Path | None:
    found = [p for p in folder.glob("step_*") if p.name.split("_")[1].isdigit()]
    return max(found, key=lambda p: int(p.name.split("_")[1])) if found else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--log-steps", type=int, default=10)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--run-name", default=None, help="default: the output directory's name")
    p.add_argument(
        "--work-ms", type=float, default=0, help="extra time a forward takes (a bigger model)"
    )
    a = p.parse_args()
    out = Path(a.output_dir)
    tracker = TrainwardenTracker(a.run_name or out.name)  # trainwarden: before the group
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Before the Accelerator: a process group that survives torchrun's restarts.
        init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    accelerator = Accelerator(
        log_with=[tracker],  # trainwarden
        gradient_accumulation_steps=a.accumulation,
        cpu=not torch.cuda.is_available(),
    )
    accelerator.init_trackers("accelerate-example", config=vars(a))

    torch.manual_seed(0)
    model = TinyLM()
    if a.work_ms:
        model.register_forward_pre_hook(lambda *_: time.sleep(a.work_ms / 1000))
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr)
    loader = torch.utils.data.DataLoader(Synthetic(4096), batch_size=a.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    tracker.watch(accelerator, model, optimizer)  # trainwarden: on every rank, before load_state

    done = {"steps": 0}  # optimizer steps done: the weights after step done - 1
    newest = newest_checkpoint(out) if out.is_dir() else None
    if newest is not None:  # a restarted job resumes
        accelerator.load_state(str(newest))
        done["steps"] = int(newest.name.split("_")[1])
        accelerator.print(f"resumed from {newest}")
    # trainwarden: a rollback restores an older checkpoint (the tracker's handler); the
    # loop's own count goes back with it, so that step_N keeps naming the weights after
    # step N - 1 and the run ends after a.steps updates of the weights it keeps.
    tw.on_rollback(lambda plan: done.update(steps=plan.checkpoint_step + 1))
    epoch, skip = divmod(done["steps"] * a.accumulation, len(loader))
    while done["steps"] < a.steps:
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for batch in batches:
            with accelerator.accumulate(model):
                ids = batch["input_ids"]
                logits = model(ids)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            done["steps"] += 1
            completed = done["steps"]
            if completed % a.save_steps == 0:
                accelerator.save_state(str(out / f"step_{completed}"))
            if completed % a.log_steps == 0:
                accelerator.log({"train/loss": loss.item()}, step=completed)
            if done["steps"] >= a.steps:  # (a rollback in log() sets it back)
                break
        epoch += 1
    accelerator.end_training()


if __name__ == "__main__":
    main()
