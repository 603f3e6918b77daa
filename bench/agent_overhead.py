"""What the agent costs the training thread, measured against a bare loop in the same run.

    python bench/agent_overhead.py [--step-ms 50] [--blocks 10] [--steps-per-block 20]
    python bench/agent_overhead.py --flight-recorder     # only measurement 4
    python bench/agent_overhead.py --replica-check       # only measurement 5
    python bench/agent_overhead.py --integrations        # only measurement 6

Six measurements; all but the fourth in this process:

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
4. PyTorch's Flight Recorder, which ``tw.init`` turns on: the same MLP under DDP, a
   2-rank gloo job per arm (the recorder is process-wide and read from the
   environment: ``TORCH_FR_BUFFER_SIZE=2000`` vs ``=0``). Both jobs stay up and run
   blocks of steps in turn (ON OFF OFF ON ...); the median step time of each arm, their
   ratio, and the spread of the ratios of neighbouring blocks; and, per block, the
   median time of a 1-float all_reduce: the recorder's cost per collective, which a
   step's few collectives hide.
5. The replica check (``tw.watch(..., replica_check_every=N)``, agent/replica.py), on the
   MLP of (3): the optimizer post-hook of an unchecked step vs the plain phase mark it
   replaces (one modulo more), the hook of a checked step (fingerprint + capture), the
   fingerprint alone and its fixed cost (the same tensors of one element each: what a
   checked step costs the training thread besides the work on the parameters, which
   a GPU does asynchronously), and a checked step's cost amortized over the default
   interval (100) as a share of the measured step; and a probed step's hook (the
   determinism probe: one eval forward of the step's input more) against that forward
   alone.

6. The framework integrations (agent/integrations), from bench/integration_overhead.py:
   each framework's own loop on a tiny model with and without trainwarden's callback,
   against a plain loop over the same model bare and with ``tw.step`` written in by
   hand, in rotating blocks; the callback's extra cost a step must not exceed the
   hand-written one's. A framework that is not installed is said and left out.

The agent sends to a transport that encodes and discards, so the exporter thread
does all its real work (reading tensors, computing splits and flags) but no network.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainwarden.agent as tw
from trainwarden.agent.wire import dumps

sys.path.insert(0, str(Path(__file__).resolve().parent))
from integration_overhead import print_integrations  # noqa: E402  (part 6: its own script)


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

    ids = torch.randperm(100_000)[:512]  # a batch's sample ids, as a loader's sampler gives

    calls_ns: list[int] = []

    def agent_step_with_ids(i: int) -> None:
        with tw.step(i, tokens=4096) as s:
            s.loss(loss)
            t0 = time.perf_counter_ns()
            s.samples(ids)
            calls_ns.append(time.perf_counter_ns() - t0)

    results = {"bare": per_call_us(bare, n)}
    agent = tw.init(run="bench-overhead", transport=NullTransport(), queue_size=1_000_000)
    # The exporter runs meanwhile (woken every 512 records), as it does in training.
    results["tw.step + s.loss"] = per_call_us(agent_step, n) - results["bare"]
    tw.shutdown(timeout_s=60)
    results["exporter CPU per record"] = agent.stats.exporter_cpu_ns / agent.stats.sent / 1000
    agent = tw.init(run="bench-overhead", transport=NullTransport(), queue_size=1_000_000)
    with_ids = per_call_us(agent_step_with_ids, n) - results["bare"]
    # The call itself, timed around it (the exporter digesting meanwhile, as in training);
    # and the loop's difference, which also holds the exporter's digest work competing for
    # the GIL in this loop of empty steps (in a real step the exporter runs in its gaps).
    results["s.samples call (512 ids)"] = statistics.median(calls_ns) / 1000
    results["s.samples loop delta"] = with_ids - results["tw.step + s.loss"]
    tw.shutdown(timeout_s=60)
    results["exporter CPU per record with ids"] = (
        agent.stats.exporter_cpu_ns / agent.stats.sent / 1000
    )
    # With a dataset size the exporter also sends the ids for the epoch coverage check:
    # all of them up to 1,048,576 samples (exact), a fixed sample beyond (sampled).
    for kind, size in (("exact", 100_000), ("sampled", 100_000_000)):
        agent = tw.init(
            run="bench-overhead",
            transport=NullTransport(),
            queue_size=1_000_000,
            dataset_size=size,
        )
        per_call_us(agent_step_with_ids, n // 4)
        tw.shutdown(timeout_s=60)
        results[f"exporter CPU per record with ids, {kind}"] = (
            agent.stats.exporter_cpu_ns / agent.stats.sent / 1000
        )
    # tw.watch_loader: what a watched DataLoader adds to each batch it yields on the
    # training thread (its sampler's indices queued and handed over, the step taking them
    # at its end). No exporter here: its digest work (above) would compete for the GIL in
    # this loop of empty steps.
    loader = DataLoader(TensorDataset(torch.arange(512 * 64)), batch_size=512)
    tw.init(run="bench-overhead", queue_size=1_000_000, gpu_interval_s=0)

    def epoch_us(batches: Any) -> float:
        t0 = time.perf_counter_ns()
        for i, _batch in enumerate(batches):
            with tw.step(i):
                pass
        return (time.perf_counter_ns() - t0) / 64 / 1000

    watched_loader = tw.watch_loader(
        DataLoader(TensorDataset(torch.arange(512 * 64)), batch_size=512)
    )
    plain, watched = [], []
    for _ in range(15):  # alternating
        plain.append(epoch_us(loader))
        watched.append(epoch_us(watched_loader))
    results["tw.watch_loader per batch (512 ids)"] = statistics.median(
        w - p for w, p in zip(watched, plain, strict=True)
    )
    tw.shutdown()
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


FR_ON, FR_OFF = "2000", "0"  # TORCH_FR_BUFFER_SIZE of each arm (2000: what tw.init asks for)
FR_TINY = 200  # 1-float all_reduces timed per block: the recorder's cost per collective


def fr_worker(rank: int, port: int, width: int) -> None:
    """One rank of a Flight Recorder arm (a child process): the sized MLP under DDP on a
    2-rank gloo group. Each line on stdin is a step count: it runs those steps, then
    FR_TINY 1-float all_reduces, and answers one JSON line (step times in ms, the median
    all_reduce in us); ``q``: what the recorder holds, then exit."""
    import torch.distributed as dist

    from trainwarden.agent import flight

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})  # one core per rank: less skew
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
    x = torch.randn(256, width)
    tiny = torch.ones(1)
    for line in sys.stdin:
        if line.strip() == "q":
            break
        steps = []
        for _ in range(int(line)):
            t0 = time.perf_counter()
            train_step(ddp, opt, x)
            steps.append((time.perf_counter() - t0) * 1000)
        ops = []
        for _ in range(FR_TINY):
            t0 = time.perf_counter()
            dist.all_reduce(tiny)
            ops.append((time.perf_counter() - t0) * 1e6)
        print(json.dumps({"steps_ms": steps, "all_reduce_us": statistics.median(ops)}), flush=True)
    dump = flight.dump(trigger="command")
    groups = {g["pg"]: g for g in dump["groups"]}
    print(
        json.dumps(
            {
                "available": dump["available"],
                "reason": dump["reason"],
                "last_seq": groups["0"]["last_enqueued"] if "0" in groups else None,
            }
        ),
        flush=True,
    )
    del ddp, opt
    dist.destroy_process_group()


class FrJob:
    """A 2-rank gloo job of one arm, waiting on its stdin between blocks."""

    def __init__(self, buffer_size: str, width: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "TORCH_FR_BUFFER_SIZE": buffer_size, "PYTHONUNBUFFERED": "1"}
        script = os.path.abspath(__file__)
        self.ranks = [
            subprocess.Popen(
                [sys.executable, script, "--fr-worker", str(rank), str(port), str(width)],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]

    def _ask(self, line: str) -> dict[str, Any]:
        """Both ranks get the line (their collectives pair up); rank 0's answer."""
        for proc in self.ranks:
            assert proc.stdin is not None
            proc.stdin.write(line + "\n")
            proc.stdin.flush()
        answers = []
        for proc in self.ranks:
            assert proc.stdout is not None
            answer = proc.stdout.readline()
            if not answer:
                raise RuntimeError(f"a flight-recorder bench rank exited (code {proc.wait()})")
            answers.append(json.loads(answer))
        return dict(answers[0])

    def block(self, steps: int) -> dict[str, Any]:
        return self._ask(str(steps))

    def close(self) -> dict[str, Any]:
        summary = self._ask("q")
        for proc in self.ranks:
            proc.wait(timeout=60)
        return summary


def _spread(on: list[float], off: list[float]) -> dict[str, float]:
    """The ratios of neighbouring blocks (on / off): median, quartiles, range."""
    pairs = sorted(a / b for a, b in zip(on, off, strict=True))
    q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) >= 2 else (pairs[0],) * 3
    return {
        "median": statistics.median(pairs),
        "q1": q1,
        "q3": q3,
        "min": pairs[0],
        "max": pairs[-1],
    }


def flight_recorder_loop(step_ms: float, blocks: int, steps_per_block: int) -> dict[str, Any]:
    """Median step time of a 2-rank DDP job with the Flight Recorder on vs off, blocks
    alternating ON OFF OFF ON (a drift of the machine falls on both arms)."""
    model, _, _ = sized_mlp(step_ms)  # sized in this process, one thread: a rank's share
    width = int(model[0].in_features)  # type: ignore[index]
    jobs = {"on": FrJob(FR_ON, width), "off": FrJob(FR_OFF, width)}
    results: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    try:
        for job in jobs.values():
            job.block(max(3, steps_per_block // 2))  # warm-up: rendezvous, first buckets
        for i in range(blocks):
            for arm in ("on", "off") if i % 2 == 0 else ("off", "on"):
                results[arm].append(jobs[arm].block(steps_per_block))
    finally:
        summaries = {arm: job.close() for arm, job in jobs.items()}
    steps = {arm: [r["steps_ms"] for r in results[arm]] for arm in results}
    tiny = {arm: [r["all_reduce_us"] for r in results[arm]] for arm in results}
    on = statistics.median(t for b in steps["on"] for t in b)
    off = statistics.median(t for b in steps["off"] for t in b)
    return {
        "width": width,
        "on_ms": on,
        "off_ms": off,
        "ratio": on / off,
        "pairs": _spread(
            [statistics.median(b) for b in steps["on"]],
            [statistics.median(b) for b in steps["off"]],
        ),
        "on_us": statistics.median(tiny["on"]),
        "off_us": statistics.median(tiny["off"]),
        "tiny_pairs": _spread(tiny["on"], tiny["off"]),
        "summaries": summaries,
    }


def _verdict(spread: dict[str, float]) -> str:
    inside = spread["q1"] <= 1.0 <= spread["q3"]
    return (
        f"per neighbouring block pair: median {spread['median']:.4f}, quartiles "
        f"[{spread['q1']:.4f}, {spread['q3']:.4f}], range [{spread['min']:.4f}, "
        f"{spread['max']:.4f}] -> " + ("within noise" if inside else "outside the noise")
    )


def print_flight_recorder(loop: dict[str, Any], blocks: int, steps_per_block: int) -> None:
    print(
        f"\n4. Flight Recorder on vs off: a 2-rank gloo DDP job per arm (MLP width "
        f"{loop['width']}), {blocks} blocks each of {steps_per_block} steps + {FR_TINY} "
        "1-float all_reduces, ON OFF OFF ON ..."
    )
    for arm, size in (("on", FR_ON), ("off", FR_OFF)):
        summary = loop["summaries"][arm]
        held = (
            f"the recorder held group 0 up to seq {summary['last_seq']}"
            if summary["available"]
            else f"no recorder: {summary['reason']}"
        )
        print(
            f"   recorder {arm:<3} (TORCH_FR_BUFFER_SIZE={size:>4}): median "
            f"{loop[f'{arm}_ms']:.2f} ms/step, 1-float all_reduce {loop[f'{arm}_us']:.1f} us ; "
            f"{held}"
        )
    print(f"   step time on/off {loop['ratio']:.4f} ; {_verdict(loop['pairs'])}")
    print(
        f"   1-float all_reduce on/off {loop['on_us'] / loop['off_us']:.4f} "
        f"({loop['on_us'] - loop['off_us']:+.1f} us per collective) ; "
        + _verdict(loop["tiny_pairs"])
    )


def replica_check_costs(step_ms: float, calls: int) -> dict[str, float]:
    """Part 5: the replica check's training-thread cost on the sized MLP (CPU)."""
    from trainwarden.agent.config import REPLICA_CHECK_EVERY
    from trainwarden.agent.probe import Probe
    from trainwarden.agent.replica import fingerprint
    from trainwarden.agent.step import StepRecord
    from trainwarden.agent.watch import _mark, _probe_hook, _replica_hook

    model, opt, x = sized_mlp(step_ms)
    params = list(model.parameters())
    steps = []
    for _ in range(15):
        t0 = time.perf_counter()
        train_step(model, opt, x)
        steps.append((time.perf_counter() - t0) * 1e6)
    step_us = statistics.median(steps[3:])

    def median_us(fn: Any, repeat: int) -> float:
        fn()
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t0) / 1000)
        return statistics.median(samples)

    tiny = [torch.zeros(1) for _ in params]
    results = {
        "width": float(model[0].in_features),  # type: ignore[index]
        "params": float(sum(p.numel() for p in params)),
        "tensors": float(len(params)),
        "step_us": step_us,
        "fixed_us": per_call_us(lambda i: fingerprint(tiny), calls // 10),
    }
    agent = tw.init(run="bench-replica", transport=NullTransport())
    unchecked, checked = StepRecord(1, None), StepRecord(REPLICA_CHECK_EVERY, None)
    recorder = agent.recorder
    recorder.current = unchecked  # the hooks write into "the step in progress"
    mark = _mark(recorder, "other")
    check = _replica_hook(recorder, model, REPLICA_CHECK_EVERY, "0-7")
    results["mark_us"] = per_call_us(lambda i: mark(), calls)
    results["unchecked_us"] = per_call_us(lambda i: check(), calls)
    recorder.current = checked

    def fingerprint_alone() -> None:
        fingerprint(params)

    def alternated(a: Any, b: Any) -> tuple[float, float]:
        """Medians of ``a`` and ``b`` timed in turn, so that a drift of this busy
        machine falls on both."""
        times: tuple[list[float], list[float]] = ([], [])
        for _ in range(30):
            times[0].append(median_us(a, 1))
            times[1].append(median_us(b, 1))
        return statistics.median(times[0]), statistics.median(times[1])

    results["fingerprint_us"], results["checked_us"] = alternated(fingerprint_alone, check)
    assert checked.replica is not None and unchecked.replica is None

    # The determinism probe at a probed step: the same hook's work plus one eval forward
    # of the step's own input under no_grad and the output's fingerprint and sums; against
    # that forward alone, the probe's own cost.
    probe = Probe(model, x)
    probed_hook = _probe_hook(recorder, model, 0, "0-7", probe, REPLICA_CHECK_EVERY, 0.0)

    def forward_alone() -> None:
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()

    results["forward_us"], results["probed_us"] = alternated(forward_alone, probed_hook)
    assert checked.probe is not None
    agent.recorder.current = None
    tw.shutdown()
    results["amortized_share"] = results["checked_us"] / REPLICA_CHECK_EVERY / step_us
    results["every"] = float(REPLICA_CHECK_EVERY)
    return results


def print_replica_check(r: dict[str, float]) -> None:
    print(
        f"\n5. replica check on the sized MLP ({r['params'] / 1e6:.2f} M float32 parameters in "
        f"{r['tensors']:.0f} tensors, width {r['width']:.0f}; step {r['step_us'] / 1000:.2f} ms)"
    )
    print(
        f"   optimizer post-hook, unchecked step: {r['unchecked_us']:.3f} us "
        f"(the plain phase mark it replaces: {r['mark_us']:.3f} us; "
        f"{r['unchecked_us'] - r['mark_us']:+.3f} us)"
    )
    print(
        f"   optimizer post-hook, checked step:   {r['checked_us']:.0f} us "
        f"(fingerprint alone {r['fingerprint_us']:.0f} us: "
        f"{r['params'] * 4 / r['fingerprint_us'] / 1e3:.2f} GB/s of parameters)"
    )
    print(
        f"   fixed cost of a fingerprint (same {r['tensors']:.0f} tensors, 1 element each): "
        f"{r['fixed_us']:.1f} us (target <= 50 us besides the work on the parameters)"
    )
    print(
        f"   a checked step amortized over the default interval ({r['every']:.0f}): "
        f"{r['checked_us'] / r['every']:.1f} us per step, {r['amortized_share'] * 100:.3f}% "
        "of a step (on a GPU the parameter work runs on the device, asynchronously)"
    )
    extra = r["probed_us"] - r["checked_us"] - r["forward_us"]
    print(
        f"   determinism probe, probed step's post-hook: {r['probed_us']:.0f} us = the checked "
        f"step's {r['checked_us']:.0f} us + one eval forward {r['forward_us']:.0f} us "
        f"{extra:+.0f} us (the output's fingerprint and sums); at determinism_probe_every="
        f"{r['every']:.0f}: {r['probed_us'] / r['every'] / r['step_us'] * 100:.3f}% of a step"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--steps-per-block", type=int, default=4)
    p.add_argument("--calls", type=int, default=2000, help="calls per timing batch in part 1")
    p.add_argument(
        "--flight-recorder",
        action="store_true",
        help="run only measurement 4 (the Flight Recorder on vs off, 2-rank gloo jobs)",
    )
    p.add_argument(
        "--replica-check",
        action="store_true",
        help="run only measurement 5 (the replica check's cost on the sized MLP)",
    )
    p.add_argument(
        "--integrations",
        action="store_true",
        help="run only measurement 6 (framework loops with vs without the callbacks)",
    )
    p.add_argument("--fr-blocks", type=int, default=16, help="blocks per arm in part 4")
    p.add_argument("--fr-steps-per-block", type=int, default=10, help="steps per block in part 4")
    p.add_argument("--fr-worker", nargs=3, type=int, help=argparse.SUPPRESS)  # rank port width
    args = p.parse_args()
    if args.fr_worker:
        fr_worker(*args.fr_worker)
        return
    torch.set_num_threads(1)

    print(
        f"trainwarden agent overhead (python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{os.cpu_count()} cpus)"
    )
    if args.flight_recorder:
        loop_fr = flight_recorder_loop(args.step_ms, args.fr_blocks, args.fr_steps_per_block)
        print_flight_recorder(loop_fr, args.fr_blocks, args.fr_steps_per_block)
        return
    if args.replica_check:
        print_replica_check(replica_check_costs(args.step_ms, args.calls))
        return
    if args.integrations:
        print_integrations(min(args.blocks, 12), max(args.steps_per_block, 30))
        return
    costs = thread_costs(args.calls)
    agent_us = costs["tw.step + s.loss"]
    print("\n1. training-thread cost per step (median, bare loop subtracted)")
    for name, us in costs.items():
        if name not in ("bare",) and not name.startswith("exporter CPU per record"):
            print(f"   {name:<26} {us:8.2f} us")
    print(f"   {'bare loop iteration':<26} {costs['bare']:8.2f} us")
    print(
        f"   exporter thread CPU per record: {costs['exporter CPU per record']:.2f} us "
        "(off the training thread; it releases the GIL every 8 records); with 512 sample "
        f"ids a step: {costs['exporter CPU per record with ids']:.2f} us (target for "
        "s.samples on the training thread: <= 5 us); and with a dataset size, sending the "
        f"ids too: {costs['exporter CPU per record with ids, exact']:.2f} us (exact, 100,000 "
        f"samples), {costs['exporter CPU per record with ids, sampled']:.2f} us (sampled, "
        "100,000,000)"
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

    loop_fr = flight_recorder_loop(args.step_ms, args.fr_blocks, args.fr_steps_per_block)
    print_flight_recorder(loop_fr, args.fr_blocks, args.fr_steps_per_block)

    print_replica_check(replica_check_costs(args.step_ms, args.calls))

    print_integrations(min(args.blocks, 12), max(args.steps_per_block, 30))


if __name__ == "__main__":
    main()
