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
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trainwarden.agent as tw
from trainwarden.agent.integrations.common import init_process_group


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
        self.sample_seed = sample_seed
        self.vocab = vocab
        self.context = context

    def batch(
        self, size: int, index: int | None = None, *, seed: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch; with ``index``, always the same batch for that index (so that a
        rollback can go back in the data and skip a window of it). ``seed``: another
        rank's sample seed (the ``data=same_batch`` drill draws rank 0's batch)."""
        if index is not None:
            self.rng.manual_seed((seed or self.sample_seed) * 1_000_003 + index)
        seq = torch.empty(size, self.context + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab, (size,), generator=self.rng)
        for i in range(1, self.context + 1):
            seq[:, i] = torch.multinomial(
                self.transitions[seq[:, i - 1]], 1, generator=self.rng
            ).squeeze(1)
        return seq[:, :-1], seq[:, -1]


def _data_drill(form: str) -> int | None:
    """The step from which a ``data=<form>`` drill (``TRAINWARDEN_DRILL``) is in force, if
    one is set: a data fault the trainer itself makes (the agent only records it)."""
    from trainwarden.agent.drills import parse

    spec = os.environ.get("TRAINWARDEN_DRILL") or ""
    found = [f.first for f in parse(spec) if f.kind == "data" and f.form == form]
    return min(found) if found else None


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
        "--checkpoint-dir", help="save checkpoints here (rank 0), and resume from the newest"
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: none)"
    )
    p.add_argument(
        "--corrupt-checkpoint",
        type=int,
        action="append",
        default=[],
        metavar="STEP",
        help="write the checkpoint of STEP with damaged weights (a drill for a rollback whose "
        "restore does not help; repeatable)",
    )
    p.add_argument(
        "--work-ms",
        type=float,
        default=0.0,
        help="extra time each step waits after its forward, as if on a device (steadier timing "
        "when many ranks share few CPU cores)",
    )
    p.add_argument(
        "--extra-group",
        action="store_true",
        help="a second process group of the upper half of the ranks, with a small all_reduce "
        "on it each step before the gradients' (a job with two process groups: a hung "
        "collective's verdict must name the right one); needs 2 or more ranks",
    )
    p.add_argument(
        "--replica-check-every",
        type=int,
        default=None,
        metavar="N",
        help="fingerprint the parameters after every N-th optimizer step, to compare the "
        "replicas (0: off; default: the agent's, TRAINWARDEN_REPLICA_CHECK_EVERY or 100)",
    )
    p.add_argument(
        "--determinism-probe-every",
        type=int,
        default=None,
        metavar="M",
        help="every M-th step, after the update, each replica runs one forward of a fixed "
        "input and fingerprints the output, to compare what the replicas compute "
        "(default: the agent's, TRAINWARDEN_DETERMINISM_PROBE_EVERY or 0: off)",
    )
    p.add_argument(
        "--loss-log",
        metavar="DIR",
        help="write each step's loss as this rank computed it to DIR/rank-<rank>.jsonl (a "
        "test compares what the collector stored with it)",
    )
    return p.parse_args(argv)


def _save(
    folder: Path,
    step: int,
    state: dict[str, int],
    model: nn.Module,
    opt: Any,
    rank: int,
    corrupt: bool = False,
) -> None:
    """Rank 0 writes (the weights are the same on every rank); every rank waits for it.
    ``corrupt``: the file holds damaged weights (a drill), the run's own are untouched."""
    path = folder / f"step-{step}.pt"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        weights = getattr(model, "module", model).state_dict()
        if corrupt:
            weights = {k: v * 40 if v.is_floating_point() else v for k, v in weights.items()}
        with tw.checkpointing(step, path):  # its blocking time and size: the checkpoint's cost
            torch.save(
                {
                    "step": step,
                    "cursor": state["cursor"],
                    "model": weights,
                    "opt": opt.state_dict(),
                },
                tmp,
            )
            tmp.rename(path)
    if dist.is_initialized():
        dist.barrier()


def _restore(path: Path, model: nn.Module, opt: Any) -> dict[str, int]:
    saved = torch.load(path, weights_only=True)
    getattr(model, "module", model).load_state_dict(saved["model"])  # DDP or not: any world size
    opt.load_state_dict(saved["opt"])
    return {"step": int(saved["step"]) + 1, "cursor": int(saved["cursor"])}


def _newest_checkpoint(folder: Path) -> Path | None:
    found = sorted(folder.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.extra_group and world < 2:
        raise SystemExit(
            f"--extra-group needs 2 or more ranks (WORLD_SIZE is {world}): run under "
            "torchrun --nproc-per-node 2 or more"
        )
    vocab, context, dim, lr = 64, 8, 32, 3e-3
    config = {
        "lr": lr,
        "optimizer": "AdamW",
        "batch_size": args.batch_size,
        "vocab": vocab,
        "context": context,
        "dim": dim,
        "seed": args.seed,
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "extra_group": args.extra_group,
    }
    # Before the process group: tw.init turns on the Flight Recorder, which the group
    # reads when it is made (rank and world size come from RANK / WORLD_SIZE).
    tw.init(
        run=args.run,
        url=args.url,
        config=config,
        tags=["demo", "cpu"],
        data_snapshot=f"markov:seed={args.seed}",
    )
    if world > 1:
        init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    extra = None  # the second group, on the ranks in it
    if args.extra_group:
        upper = list(range(world // 2, world))
        # Every rank calls new_group, in it or not. The description names it in the
        # Flight Recorder's dumps (and so in the hung-collective verdict).
        group = dist.new_group(ranks=upper, group_desc="upper_half")
        extra = group if rank in upper else None

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model: nn.Module = TinyLM(vocab, context, dim=dim)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = MarkovData(vocab, context, chain_seed=args.seed, sample_seed=args.seed + 1 + rank)
    # Phases, comm split (DDP), MFU, grad-norm spikes; the replicas' fingerprints (and,
    # when asked, the determinism probe: the demo model's kernels are deterministic on the
    # CPU, so probes compare bit-exactly).
    tw.watch(
        model,
        opt,
        grad_norm=True,
        replica_check_every=args.replica_check_every,
        determinism_probe_every=args.determinism_probe_every,
    )
    state = {"step": args.start_step, "cursor": args.start_step}  # next step, next data batch
    end = args.start_step + args.steps
    ckpt_dir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt_dir is not None and (newest := _newest_checkpoint(ckpt_dir)) is not None:
        state.update(_restore(newest, model, opt))  # a restarted job resumes (Slurm requeue)
        if _data_drill("forget_sampler_state") is not None:
            # The data=forget_sampler_state drill: a trainer that does not checkpoint its
            # sampler starts it again from its seed (batch 0) on resume.
            state["cursor"] = 0
        print(f"resumed from {newest} at step {state['step']}", flush=True)

    def rollback(plan: tw.RollbackPlan) -> None:
        """trainwarden asks every rank, at the same step: go back to a good checkpoint."""
        state.update(_restore(Path(plan.checkpoint_path), model, opt))
        if plan.lr_scale:
            for group in opt.param_groups:
                group["lr"] *= plan.lr_scale
        skipping = (
            f"skipping batches {plan.skip_from}-{plan.skip_to}"
            if plan.skip_to >= plan.skip_from
            else "replaying the same batches"
        )
        print(
            f"rolled back to step {plan.checkpoint_step} after step {plan.barrier_step}; "
            f"{skipping} (at {time.time():.3f})",  # this process's clock, for a post-mortem's
            flush=True,
        )

    tw.on_rollback(rollback)
    same_batch = _data_drill("same_batch")
    losses = None
    if args.loss_log:
        Path(args.loss_log).mkdir(parents=True, exist_ok=True)
        losses = (Path(args.loss_log) / f"rank-{rank}.jsonl").open("w", buffering=1)
    while state["step"] < end:
        step = state["step"]
        if args.data_delay:
            time.sleep(args.data_delay)  # shows up as data wait: the gap between steps
        while tw.should_skip_batch(state["cursor"]):
            state["cursor"] += 1  # data a rollback told us to leave out
        # The batch's sample ids: a virtual dataset in which batch c of rank r holds ids
        # (c * world + r) * B ... + B - 1. Under the data=same_batch drill, from its step
        # on every rank draws rank 0's batch (a sampler that ignores the rank).
        source = 0 if same_batch is not None and step >= same_batch else rank
        x, y = data.batch(args.batch_size, index=state["cursor"], seed=args.seed + 1 + source)
        first_id = (state["cursor"] * world + source) * args.batch_size
        ids = torch.arange(first_id, first_id + args.batch_size)
        state["cursor"] += 1
        state["step"] += 1  # before the step ends: a rollback at its end sets the next one
        with tw.step(step, tokens=x.numel()) as s:
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            if args.work_ms:
                time.sleep(args.work_ms / 1000)
            if extra is not None:
                # The step's first collective is on the second group, then DDP's gradient
                # all_reduce on the default one.
                dist.all_reduce(loss.detach().expand(4).clone(), group=extra)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.loss(loss)
            s.samples(ids)  # which samples: the collector finds one batch on several ranks
            s.lr(opt.param_groups[0]["lr"])  # the built-in series lr
            # The trainer's own metrics (s.metric): per rank, rolled up across ranks, and a
            # rank x step heatmap on the Ranks page. A tensor is read off this thread, later.
            s.metric("accuracy", (logits.detach().argmax(-1) == y).float().mean())
            if ckpt_dir is not None and args.checkpoint_every and step % args.checkpoint_every == 0:
                _save(ckpt_dir, step, state, model, opt, rank, step in args.corrupt_checkpoint)
        if losses is not None:
            losses.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
    tw.shutdown()
    if losses is not None:
        losses.close()
    if world > 1:
        # Free DDP first: its reducer holds the process group, and a gloo group torn down
        # at interpreter exit made torch abort a rank in 32 of 155 two-rank runs here
        # ("terminate called without an active exception"), trainwarden or not.
        del model, opt
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
