"""A Hugging Face Trainer observed by trainwarden: a tiny GPT-2 built from a config (no
download) learns a synthetic language (each token follows from the one before with a
fixed table, plus noise), on CPU or GPU, one process or many under torchrun.

    pip install 'trainwarden[hf]'
    trainwarden serve &                                   # the collector, on :8000
    TRAINWARDEN_URL=http://127.0.0.1:8000 TRAINWARDEN_TOKEN=... \\
        torchrun --nproc-per-node 2 examples/hf_trainer.py --output-dir /tmp/hf-run

The two lines that matter are marked ``# trainwarden``. A restarted job (torchrun
``--max-restarts``, a Slurm requeue) resumes from the newest checkpoint in the output
directory.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from trainwarden.agent.integrations.common import init_process_group
from trainwarden.agent.integrations.hf import TrainwardenCallback  # trainwarden

VOCAB, LENGTH = 64, 32


class Synthetic(torch.utils.data.Dataset):
    """Sequences where token t+1 = (5 * token t + 3) mod VOCAB, with 10 % noise."""

    def __init__(self, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        first = torch.randint(0, VOCAB, (size, 1), generator=g)
        rows = [first]
        for _ in range(LENGTH - 1):
            nxt = (rows[-1] * 5 + 3) % VOCAB
            noise = torch.rand(size, 1, generator=g) < 0.1
            rows.append(torch.where(noise, torch.randint(0, VOCAB, (size, 1), generator=g), nxt))
        self.ids = torch.cat(rows, dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--run-name", default=None)
    p.add_argument(
        "--work-ms", type=float, default=0, help="extra time a forward takes (a bigger model)"
    )
    a = p.parse_args()
    callback = TrainwardenCallback()  # trainwarden: before the process group (Flight Recorder)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Before the Trainer: a process group that survives torchrun's restarts.
        init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=0,
            eos_token_id=0,  # within the tiny vocabulary
        )
    )
    if a.work_ms:
        model.register_forward_pre_hook(lambda *_: time.sleep(a.work_ms / 1000))
    args = TrainingArguments(
        output_dir=a.output_dir,
        run_name=a.run_name,
        max_steps=a.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=a.accumulation,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        save_steps=a.save_steps,
        logging_steps=10,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        ddp_backend="nccl" if torch.cuda.is_available() else "gloo",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Synthetic(4096),
        callbacks=[callback],
    )
    newest = get_last_checkpoint(a.output_dir) if os.path.isdir(a.output_dir) else None
    trainer.train(resume_from_checkpoint=newest)  # a restarted job resumes


if __name__ == "__main__":
    main()
