"""An FSDP2 trainer in the torchtitan style, observed by trainwarden: a tiny causal
transformer built in code (no download), ``fully_shard`` on each block and on the root over
a device mesh, a plain loop, ``torch.distributed.checkpoint`` checkpoints; it learns a
synthetic language (each token follows from the one before with a fixed table, plus
noise), on CPU (gloo) or GPU (NCCL), under torchrun.

    pip install 'trainwarden[agent]'
    trainwarden serve &                                   # the collector, on :8000
    TRAINWARDEN_URL=http://127.0.0.1:8000 TRAINWARDEN_TOKEN=... \\
        torchrun --nproc-per-node 2 examples/fsdp2_trainer.py --output-dir /tmp/fsdp2-run
    # HSDP: 2 replicas of a 2-way shard (4 ranks)
    torchrun --nproc-per-node 4 examples/fsdp2_trainer.py --output-dir /tmp/hsdp --replicate 2

The lines that matter are marked ``# trainwarden``. The mesh is 1-D (``shard``: plain
FSDP2, every rank holds a different shard) or, with ``--replicate R``, 2-D
(``replicate`` x ``shard``: HSDP), whose replicate dimension is the replica group the
agent compares parameter fingerprints in. FSDP2 has no DDP communication hook: the comm
split comes from the sampled profiler window (``profile_every``). A restarted job resumes
from the newest checkpoint in the output directory; a rollback from the collector
restores the one it names, in process (:func:`rollback` below).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import trainwarden.agent as tw  # trainwarden
from trainwarden.agent.integrations.common import init_process_group

VOCAB, LENGTH = 64, 32


def batch(index: int, rank: int, size: int) -> torch.Tensor:
    """Data batch ``index`` of ``rank``: sequences where token t+1 = (5 * token t + 3) mod
    VOCAB, with 10 % noise. Any batch can be drawn again (a resume, a rollback)."""
    g = torch.Generator().manual_seed(1_000_003 * index + rank)
    rows = [torch.randint(0, VOCAB, (size, 1), generator=g)]
    for _ in range(LENGTH - 1):
        nxt = (rows[-1] * 5 + 3) % VOCAB
        noise = torch.rand(size, 1, generator=g) < 0.1
        rows.append(torch.where(noise, torch.randint(0, VOCAB, (size, 1), generator=g), nxt))
    return torch.cat(rows, dim=1)


class Transformer(nn.Module):
    """Embeddings, causal blocks (each its own FSDP unit), a final norm and a head."""

    def __init__(self, dim: int, layers: int, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.zeros(LENGTH, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The next-token loss of ``ids`` (the model's output is the loss, not a view of
        the logits: FSDP2 warns about views it returns)."""
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        x = self.embed(ids) + self.pos[:n]
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x[:, :-1]))
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def save(path: Path, model: nn.Module, opt: Any, state: dict[str, int], step: int) -> None:
    """Every rank writes its shards (``dcp.save`` is collective); rank 0 times and reports
    the checkpoint (when its save returns, every rank's shards are written)."""
    sd = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "trainer": {"step": step, "cursor": state["cursor"]},
    }
    timing = tw.checkpointing(step, path) if dist.get_rank() == 0 else contextlib.nullcontext()
    with timing:  # trainwarden: the checkpoint's step (weights after update `step`) and cost
        dcp.save(sd, checkpoint_id=path)


def restore(path: Path, model: nn.Module, opt: Any) -> dict[str, int]:
    """Load a checkpoint into the sharded model and optimizer: the step it holds and the
    data position after it."""
    sd: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, opt),
        "trainer": {"step": 0, "cursor": 0},
    }
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    return {"step": int(sd["trainer"]["step"]), "cursor": int(sd["trainer"]["cursor"])}


def newest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint (``dcp.save`` writes ``.metadata`` last)."""
    done = [p for p in folder.glob("step-*") if (p / ".metadata").exists()]
    return max(done, key=lambda p: int(p.name.split("-")[1])) if done else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--replicate", type=int, default=1, help="HSDP: replicas of the shard group")
    p.add_argument("--profile-every", type=int, default=50, help="the profiler's window cadence")
    p.add_argument("--replica-check-every", type=int, default=50)
    p.add_argument(
        "--run-name",
        default=None,
        help="default: TRAINWARDEN_RUN, else the output directory's name",
    )
    p.add_argument("--work-ms", type=float, default=0, help="extra time a step takes")
    a = p.parse_args()
    out = Path(a.output_dir)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % a.replicate:
        raise SystemExit(f"--replicate {a.replicate} does not divide the world size {world}")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = Transformer(a.dim, a.layers).to(device)
    params = sum(p.numel() for p in model.parameters())
    shape = (a.replicate, world // a.replicate) if a.replicate > 1 else (world,)
    dims = ("replicate", "shard") if a.replicate > 1 else ("shard",)
    # trainwarden: before the process group (the Flight Recorder); the mesh in the config;
    # one step in `profile_every` runs under torch.profiler: the comm split FSDP2 gets.
    tw.init(
        run=a.run_name or os.environ.get("TRAINWARDEN_RUN") or out.name,
        config={
            **vars(a),
            "framework": f"torch {torch.__version__} fully_shard",
            "mesh": {"shape": list(shape), "dims": list(dims)},
            "params": params,
        },
        profile_every=a.profile_every,
        flops_per_token=6 * params,
    )
    init_process_group("nccl" if cuda else "gloo")  # survives torchrun's restarts
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=dims)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # one all-gather / reduce-scatter unit per block
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    replicas = mesh["replicate"].mesh.flatten().tolist() if a.replicate > 1 else None
    # trainwarden: phases; with HSDP the replicas' parameter fingerprints (plain FSDP2 has
    # no replica: no check). The gradient norm is the loop's own (s.grad_norm below).
    watched = tw.watch(
        model, opt, replica_group=replicas, replica_check_every=a.replica_check_every
    )
    print(
        f"rank {rank}: mesh {dict(zip(dims, shape, strict=True))}, replicas {watched.replica_group}"
    )

    state = {"step": 0, "cursor": 0}  # the next step, the next data batch
    newest = newest_checkpoint(out) if out.is_dir() else None
    if newest is not None:  # a restarted job resumes
        saved = restore(newest, model, opt)
        state = {"step": saved["step"] + 1, "cursor": saved["cursor"]}
        print(f"rank {rank}: resumed from {newest} at step {state['step']}", flush=True)

    def rollback(plan: tw.RollbackPlan) -> None:
        """trainwarden asks every rank, after the same step: go back to a good checkpoint."""
        saved = restore(Path(plan.checkpoint_path), model, opt)
        state.update(step=plan.checkpoint_step + 1, cursor=saved["cursor"])
        if plan.lr_scale:
            for group in opt.param_groups:
                group["lr"] *= plan.lr_scale
        print(
            f"rank {rank}: rolled back to {plan.checkpoint_path} (step {plan.checkpoint_step}) "
            f"after step {plan.barrier_step}",
            flush=True,
        )

    tw.on_rollback(rollback)  # trainwarden
    while state["step"] < a.steps:
        step = state["step"]
        while tw.should_skip_batch(state["cursor"]):  # trainwarden: the window a rollback skips
            state["cursor"] += 1
        ids = batch(state["cursor"], rank, a.batch_size).to(device)  # each rank its own
        state["cursor"] += 1
        state["step"] += 1  # before the step ends: a rollback at its end sets the next one
        with tw.step(step, tokens=ids.numel()) as s:  # trainwarden
            loss = model(ids)
            if a.work_ms:
                time.sleep(a.work_ms / 1000)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            s.loss(loss)  # trainwarden: this rank's loss, read off the training thread
            # trainwarden: the total norm (a DTensor: its full value, as torchtitan logs it)
            s.grad_norm(norm.full_tensor() if isinstance(norm, DTensor) else norm)
            if (step + 1) % a.save_every == 0:
                save(out / f"step-{step}", model, opt, state, step)
    tw.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
