"""A Ray Train ``TorchTrainer`` observed by trainwarden: a tiny transformer built in code
(no download) learns a synthetic language (each token follows from the one before with a
fixed table, plus noise; both in examples/tiny_lm.py) in each of Ray's workers, with DDP
over gloo (CPU) or NCCL.

    pip install 'trainwarden[ray]'
    trainwarden serve &                                   # the collector, on :8000
    export TRAINWARDEN_URL=http://127.0.0.1:8000 TRAINWARDEN_TOKEN=...
    python examples/ray_trainer.py --output-dir /tmp/ray-runs --name ray-demo

The collector's URL and token reach the workers through Ray's ``runtime_env`` (its
``env_vars``), which this script passes to ``ray.init``: every ``TRAINWARDEN_*`` variable of
the driver's environment. The run is Ray's experiment name (``--name``). The loop is a
hand-written one (``tw.step``, ``s.loss``, ``tw.watch``); ``tw_ray.wrap`` (marked
``# trainwarden``) gives the agent Ray's identity and attempts, reports the checkpoints of
``ray.train.report`` and flushes at the end. A worker that dies makes Ray restart the
group (``--max-failures``): the new group resumes from the last reported checkpoint.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import ray
import ray.train
import ray.train.torch
import tiny_lm
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from tiny_lm import TinyLM, synthetic

import trainwarden.agent as tw
from trainwarden.agent.integrations import ray as tw_ray  # trainwarden


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: DDP over the group Ray made, a checkpoint reported every
    ``save_steps`` steps, resumed from Ray's last one after a restart."""
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(TinyLM(work_ms=config["work_ms"]))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    inner = getattr(model, "module", model)  # DDP's, with more than one worker
    state = {"next": 0}

    def restore(path: str) -> None:
        saved = torch.load(os.path.join(path, "state.pt"), weights_only=True)
        inner.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state["next"] = saved["step"] + 1

    resumed = ray.train.get_checkpoint()
    if resumed is not None:  # Ray restarted the group: from its last reported checkpoint
        with resumed.as_directory() as path:
            restore(path)
        print(f"ray_trainer: resumed from {resumed.path} at step {state['next']}", flush=True)
    # A rollback from the collector: every worker restores the checkpoint at one step.
    tw.on_rollback(lambda plan: restore(plan.checkpoint_path))
    tw.watch(model, opt, grad_norm=True)
    data = synthetic(4096, seed=rank)
    g = torch.Generator().manual_seed(1000 * rank + state["next"])
    while state["next"] < config["steps"]:
        step = state["next"]
        state["next"] = step + 1  # a rollback at this step's end sets it back
        ids = data[torch.randint(0, len(data), (config["batch_size"],), generator=g)]
        with tw.step(step, tokens=ids.numel()) as s:
            loss = model(ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.loss(loss.detach())
        if (step + 1) % config["save_steps"] == 0 and state["next"] == step + 1:
            with tempfile.TemporaryDirectory() as tmp:
                checkpoint = None
                if rank == 0:
                    torch.save(
                        {
                            "model": inner.state_dict(),
                            "optimizer": opt.state_dict(),
                            "step": step,
                        },
                        os.path.join(tmp, "state.pt"),
                    )
                    checkpoint = Checkpoint.from_directory(tmp)
                ray.train.report({"step": step}, checkpoint=checkpoint)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True, help="Ray's storage path")
    p.add_argument("--name", default="ray-demo", help="the experiment: trainwarden's run")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-failures", type=int, default=1)
    p.add_argument("--work-ms", type=float, default=0, help="extra time a forward takes")
    a = p.parse_args()
    env = {k: v for k, v in os.environ.items() if k.startswith("TRAINWARDEN_")}
    # The workers cannot import examples/tiny_lm.py: the loop carries it by value.
    ray.cloudpickle.register_pickle_by_value(tiny_lm)
    ray.init(
        num_cpus=a.workers,
        object_store_memory=int(2e8),
        include_dashboard=False,
        runtime_env={"env_vars": env},  # the collector's URL and token, to every worker
    )
    trainer = TorchTrainer(
        tw_ray.wrap(train_loop),  # trainwarden
        train_loop_config={
            "steps": a.steps,
            "save_steps": a.save_steps,
            "batch_size": a.batch_size,
            "lr": a.lr,
            "work_ms": a.work_ms,
        },
        scaling_config=ScalingConfig(num_workers=a.workers, use_gpu=torch.cuda.is_available()),
        run_config=RunConfig(
            name=a.name,
            storage_path=os.path.abspath(a.output_dir),
            failure_config=FailureConfig(max_failures=a.max_failures),
        ),
    )
    result = trainer.fit()
    print(f"ray: finished, last checkpoint {result.checkpoint}")


if __name__ == "__main__":
    main()
