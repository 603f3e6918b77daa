"""One rank of the comm-split experiment (run by tests/e2e/test_comm_split.py).

A user's DDP comm hook delays the completion of the last gradient bucket by X ms on
odd steps only; the agent's records go to a JSON file through the transport seam.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import trainwarden.agent as tw


class FileTransport:
    def __init__(self, path: str) -> None:
        self.path = path
        self.steps: list[dict[str, Any]] = []

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.steps.extend(body["steps"])
        return {}

    def close(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.steps, f)


def main(out_dir: str, delays_ms: list[int], steps_per_delay: int) -> None:
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})  # one core per rank: less skew
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(6)])
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    tw.init(
        run="comm-split",
        transport=FileTransport(f"{out_dir}/rank{rank}.json"),
        flush_interval_s=0.2,
    )
    tw.watch(ddp, opt, count_flops=False)

    state = {"step": 0, "delay_s": 0.0}
    slept: dict[int, float] = {}  # step: how long the delay really slept (a loaded host oversleeps)

    def user_hook(st, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        future = default_hooks.allreduce_hook(None, bucket)
        if bucket.is_last() and st["step"] % 2 == 1:

            def delay(fut: Any) -> Any:
                started = time.perf_counter()
                time.sleep(st["delay_s"])
                slept[st["step"]] = time.perf_counter() - started
                return fut.value()

            return future.then(delay)
        return future

    ddp.register_comm_hook(state, user_hook)  # after tw.watch: chained, not replaced
    x = torch.randn(64, 512)
    step = 0
    for delay_ms in delays_ms:
        state["delay_s"] = delay_ms / 1000
        for _ in range(steps_per_delay):
            state["step"] = step
            with tw.step(step) as s:
                loss = ddp(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                s.loss(loss)
            step += 1
    tw.shutdown()
    with open(f"{out_dir}/rank{rank}-slept.json", "w") as f:
        json.dump(slept, f)
    # DDP (its reducer) holds the process group: free it before destroying the group. Left
    # to interpreter exit, torch's gloo aborted a rank in 32 of 155 two-rank runs here
    # ("terminate called without an active exception", SIGABRT), trainwarden or not.
    del ddp, opt, model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], [int(v) for v in sys.argv[2].split(",")], int(sys.argv[3]))
