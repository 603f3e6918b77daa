"""What the agent costs the training thread, measured against a bare loop in the same run.

    python bench/agent_overhead.py [--step-ms 50] [--blocks 10] [--steps-per-block 20]

Three measurements, all in this process:

1. Training-thread cost per step (microseconds): the same tiny step body timed bare,
   under ``tw.step`` + ``s.loss``, under ``tw.watch`` hooks on a model (forward and
   optimizer hooks firing), and under ``wandb.log`` in offline mode when wandb is
   installed. Medians over many repetitions, bare-loop time subtracted.
2. That cost as a fraction of a step of ``--step-ms`` (default 50 ms).
3. A real training loop (an MLP sized to about ``--step-ms`` per step) run in
   alternating blocks with and without the agent; the median step times and their
   ratio. On a busy 2-core machine this is noisy (a few %), which is why (1) is the
   precise figure and (3) the check that nothing else (the exporter thread, the
   GIL) leaks into the step.

The agent sends to a transport that encodes and discards, so the exporter thread
does all its real work (reading tensors, computing splits and flags) but no network.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import trainwarden.agent as tw
from trainwarden.agent.wire import dumps


class NullTransport:
    def __init__(self) -> None:
        self.records = 0

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        dumps(body)  # what the HTTP transport serializes
        self.records += len(body["steps"])
        return {}

    def close(self) -> None:
        pass


def per_call_us(fn: Any, n: int) -> float:
    """Median per-call time of fn() in microseconds, over 25 batches of n calls."""
    samples = []
    for _ in range(25):
        t0 = time.perf_counter_ns()
        for i in range(n):
            fn(i)
        samples.append((time.perf_counter_ns() - t0) / n / 1000)
    return statistics.median(samples)


def thread_costs(n: int) -> dict[str, float]:
    loss = torch.tensor(2.5)

    def bare(i: int) -> None:
        pass

    def agent_step(i: int) -> None:
        with tw.step(i, tokens=4096) as s:
            s.loss(loss)

    results = {"bare": per_call_us(bare, n)}
    agent = tw.init(run="bench-overhead", transport=NullTransport(), queue_size=1_000_000)
    # The exporter runs meanwhile (woken every 512 records), as it does in training.
    results["tw.step + s.loss"] = per_call_us(agent_step, n) - results["bare"]
    tw.shutdown(timeout_s=60)
    results["exporter CPU per record"] = agent.stats.exporter_cpu_ns / agent.stats.sent / 1000
    tw.init(run="bench-overhead", transport=NullTransport(), queue_size=1_000_000)

    # tw.watch: forward pre/post and optimizer pre/post hooks fire in each step.
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(2, 8)

    def unwatched(i: int) -> None:
        with tw.step(i) as s:
            model(x)
            opt.step()
            s.loss(loss)

    base = per_call_us(unwatched, n // 4)
    handle = tw.watch(model, opt, count_flops=False)
    results["tw.watch hooks (extra)"] = per_call_us(unwatched, n // 4) - base
    handle.remove()
    tw.shutdown()

    try:
        import wandb
    except ImportError:
        results["wandb.log (offline)"] = float("nan")
        return results
    os.environ["WANDB_SILENT"] = "true"
    with tempfile.TemporaryDirectory() as tmp:
        run = wandb.init(project="trainwarden-bench", mode="offline", dir=tmp)

        def wandb_step(i: int) -> None:
            # What a trainer logs per step: the loss needs a host value for wandb.
            run.log({"loss": float(loss), "tokens": 4096, "step_time": 0.05}, step=i)

        results["wandb.log (offline)"] = per_call_us(wandb_step, max(n // 20, 50)) - results["bare"]
        run.finish()
    return results


def sized_mlp(step_ms: float) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """An MLP whose forward + backward + SGD step takes about step_ms here."""
    width = 256
    while True:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        x = torch.randn(256, width)
        t0 = time.perf_counter()
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        took = (time.perf_counter() - t0) / 3 * 1000
        if took >= step_ms * 0.8 or width >= 8192:
            return model, opt, x
        width = int(width * min(2.0, (step_ms / took) ** 0.5 * 1.05))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """One step of the sized MLP: forward, backward, update; returns the loss."""
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def training_loop(step_ms: float, blocks: int, steps_per_block: int) -> dict[str, float]:
    """Median step time bare vs. with the agent and tw.watch, blocks interleaved A/B/A/B.

    The same schedule is run once more with the agent off in both arms (A/A): the
    ratio it gives is this machine's noise floor for the comparison.
    """
    model, opt, x = sized_mlp(step_ms)

    def one_step(i: int, with_agent: bool) -> float:
        t0 = time.perf_counter()
        if with_agent:
            with tw.step(i, tokens=x.shape[0]) as s:
                s.loss(train_step(model, opt, x))
        else:
            train_step(model, opt, x)
        return time.perf_counter() - t0

    def schedule(agent_arm: bool) -> tuple[float, float]:
        times: dict[bool, list[float]] = {False: [], True: []}
        step = 0
        for block in range(blocks * 2):
            arm = block % 2 == 1
            for _ in range(steps_per_block):
                times[arm].append(one_step(step, arm and agent_arm))
                step += 1
        return statistics.median(times[False]) * 1000, statistics.median(times[True]) * 1000

    tw.init(run="bench-loop", transport=NullTransport())
    watch = tw.watch(model, opt, count_flops=False)
    bare, agent = schedule(True)
    watch.remove()
    tw.shutdown()
    a1, a2 = schedule(False)
    return {"bare_ms": bare, "agent_ms": agent, "ratio": agent / bare, "aa_ratio": a2 / a1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--steps-per-block", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000, help="calls per timing batch in part 1")
    args = p.parse_args()
    torch.set_num_threads(1)

    print(
        f"trainwarden agent overhead (python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{os.cpu_count()} cpus)"
    )
    costs = thread_costs(args.calls)
    agent_us = costs["tw.step + s.loss"]
    print("\n1. training-thread cost per step (median, bare loop subtracted)")
    for name, us in costs.items():
        if name not in ("bare", "exporter CPU per record"):
            print(f"   {name:<26} {us:8.2f} us")
    print(f"   {'bare loop iteration':<26} {costs['bare']:8.2f} us")
    print(
        f"   exporter thread CPU per record: {costs['exporter CPU per record']:.2f} us "
        "(off the training thread; it releases the GIL every 8 records)"
    )
    wandb_us = costs["wandb.log (offline)"]
    if wandb_us == wandb_us:  # not NaN
        print(f"   wandb.log / tw.step cost ratio: {wandb_us / agent_us:.1f}x (target >= 10x)")
    else:
        print("   wandb not installed: no peer figure")

    total_us = agent_us + costs["tw.watch hooks (extra)"]
    share, total_share = agent_us / (args.step_ms * 10), total_us / (args.step_ms * 10)
    print(
        f"\n2. as a share of a {args.step_ms:.0f} ms step: tw.step {share:.4f}% ; "
        f"with tw.watch hooks {total_share:.4f}% (target <= 0.5%)"
    )

    loop = training_loop(args.step_ms, args.blocks, args.steps_per_block)
    print(
        f"\n3. alternating blocks of a real ~{args.step_ms:.0f} ms step "
        f"({args.blocks} blocks each, {args.steps_per_block} steps per block)"
    )
    print(
        f"   bare {loop['bare_ms']:.2f} ms ; with agent + tw.watch {loop['agent_ms']:.2f} ms ; "
        f"ratio {loop['ratio']:.4f}"
    )
    print(f"   A/A noise floor (agent off in both arms): ratio {loop['aa_ratio']:.4f}")


if __name__ == "__main__":
    main()
