"""A DeepSpeed loop observed by trainwarden: a tiny transformer built in code (no
download) learns a synthetic language (each token follows from the one before with a
fixed table, plus noise; both in examples/tiny_lm.py) under ZeRO stage 1 or 2, on CPU or
GPU.

    pip install 'trainwarden[deepspeed]'
    trainwarden serve &                                   # the collector, on :8000
    export TRAINWARDEN_URL=http://127.0.0.1:8000 TRAINWARDEN_TOKEN=... TRAINWARDEN_RUN=ds-demo
    torchrun --nproc-per-node 2 examples/deepspeed_trainer.py --output-dir /tmp/ds-run
    deepspeed --num_gpus 2 examples/deepspeed_trainer.py --output-dir /tmp/ds-run   # its launcher

On CPU set ``DS_ACCELERATOR=cpu`` (gloo; the first run JIT-builds DeepSpeed's
``deepspeed_shm_comm`` op, ~2 minutes, then cached in ``~/.cache/torch_extensions``).
The optimizer is torch's AdamW, handed to ``deepspeed.initialize`` (DeepSpeed's own
CPU Adam would need a C++ build too). The line that matters is marked ``# trainwarden``.
A restarted job (torchrun ``--max-restarts``) resumes from the newest checkpoint
(DeepSpeed's ``latest`` file).
"""

from __future__ import annotations

import argparse
import logging
import os

import deepspeed
import torch
from tiny_lm import TinyLM, synthetic

from trainwarden.agent.integrations import deepspeed as tw_deepspeed  # trainwarden
from trainwarden.agent.integrations.common import init_process_group


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--zero-stage", type=int, choices=(1, 2), default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--work-ms", type=float, default=0, help="extra time a forward takes")
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher's
    a = p.parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    cuda = torch.cuda.is_available()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Before deepspeed.initialize (which then uses it): a process group that
        # survives torchrun's restarts.
        init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    model = TinyLM(work_ms=a.work_ms)
    config = {
        "train_micro_batch_size_per_gpu": a.batch_size,
        "gradient_accumulation_steps": a.accumulation,
        "zero_optimization": {"stage": a.zero_stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=a.lr), config=config
    )
    tw_deepspeed.watch(engine)  # trainwarden
    checkpoints = os.path.join(a.output_dir, "checkpoints")
    if os.path.exists(os.path.join(checkpoints, "latest")):  # a restarted job resumes
        engine.load_checkpoint(checkpoints)
    data = synthetic(4096, seed=engine.global_rank)  # each rank its own shard
    g = torch.Generator().manual_seed(1000 * engine.global_rank + engine.global_steps)
    device = engine.device
    saved = {engine.global_steps}
    while engine.global_steps < a.steps:
        for _ in range(engine.gradient_accumulation_steps()):
            ids = data[torch.randint(0, len(data), (a.batch_size,), generator=g)].to(device)
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
        done = engine.global_steps  # a rollback may have set it back
        if done % a.save_steps == 0 and done not in saved:
            engine.save_checkpoint(checkpoints)  # tag global_step{done}
            saved.add(done)


if __name__ == "__main__":
    main()
