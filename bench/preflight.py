"""What ``tw.init(preflight=True)`` costs a job's start, against the same start without it,
in the same run.

    python bench/preflight.py [--world 2] [--repeats 5]

A gloo job of ``--world`` processes on this machine (``mp.spawn``; no collector: the
agent keeps its records local), each timing from ``tw.init`` (then its process group) to
the end of its first ``tw.step`` (the preflight runs at that step's entry), with preflight on and
off, alternating, ``--repeats`` times each. Printed: each arm's median start, their
difference (what preflight adds to a job's start), and the preflight's own wall time and
measures, as the ranks' events report them.
"""

from __future__ import annotations

import argparse
import ast
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import trainwarden.agent as tw


class Keep:
    """A transport that keeps the preflight events in memory (no collector)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.events += [e for e in body.get("events", ()) if e["kind"] == "preflight"]
        return {}

    def close(self) -> None:
        pass


def rank_main(rank: int, world: int, port: int, preflight: bool, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    started = time.perf_counter()
    keep = Keep()
    tw.init(
        run="bench-preflight",
        rank=rank,
        world_size=world,
        transport=keep,
        gpu_interval_s=0,
        preflight=preflight,
        profile_every=0,
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    with tw.step(0):
        dist.all_reduce(torch.ones(1))
    took = time.perf_counter() - started
    tw.shutdown()
    dist.destroy_process_group()
    data = keep.events[0]["data"] if keep.events else {}
    with open(f"{out}/{rank}", "w") as f:
        f.write(repr((took, data)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(world: int, preflight: bool) -> list[tuple[float, dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(world, free_port(), preflight, out), nprocs=world, join=True)
        return [ast.literal_eval(open(f"{out}/{r}").read()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    starts: dict[bool, list[float]] = {False: [], True: []}
    measured: list[dict[str, Any]] = []
    worst: dict[str, float] = {"gemm_flops": 1.0, "copy_bytes_per_s": 1.0}
    for _ in range(args.repeats):
        for on in (False, True):
            ranks = job(args.world, on)
            starts[on].append(max(took for took, _ in ranks))  # the job starts with its slowest
            if on:
                measured += [data for _, data in ranks]
                for key in worst:  # the lowest rank against its job's median: 0.85 fails
                    values = [data[key] for _, data in ranks]
                    worst[key] = min(worst[key], min(values) / statistics.median(values))
    off, on = statistics.median(starts[False]), statistics.median(starts[True])
    print(f"world {args.world}, {args.repeats} starts each, interleaved (OMP_NUM_THREADS=1)")
    print(f"  start to the end of step 0, slowest rank: without {off:.2f} s, with {on:.2f} s")
    print(f"  preflight adds {on - off:.2f} s to the job's start (median of each arm)")
    took = [d["took_s"] for d in measured]
    print(f"  the preflight itself: {statistics.median(took):.2f} s a rank (max {max(took):.2f})")
    gemm = [d["gemm_flops"] / 1e9 for d in measured]
    copy = [d["copy_bytes_per_s"] / 1e9 for d in measured]
    reduce = [d["allreduce_bytes_per_s"] / 1e9 for d in measured if d["allreduce_bytes_per_s"]]
    print(
        f"  GEMM {statistics.median(gemm):.1f} GFLOP/s (spread {min(gemm):.1f}-{max(gemm):.1f}), "
        f"copy {statistics.median(copy):.1f} GB/s ({min(copy):.1f}-{max(copy):.1f}), "
        f"all-reduce {statistics.median(reduce):.2f} GB/s"
    )
    print(
        f"  the lowest rank against its job's median (0.85 fails it): GEMM "
        f"{worst['gemm_flops']:.2f}x, copy {worst['copy_bytes_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
