"""One gloo rank of a job that dies in a collective (run by tests/e2e/test_job_lost.py
under torchrun): plain torch, no drills.

Every rank all-reduces a small tensor each step. ``fault`` at step ``at``:

- ``hang``: rank 2 sleeps instead of entering the step's all_reduce (the others wait in it);
- ``desync``: rank 1 all-gathers where the others all-reduce;
- ``none``: nothing: the job runs ``at + 400`` steps (or until SIGTERM, a preemption).

``exit_after`` > 0: ``exit_after`` seconds after step ``at`` began, every rank ends with
``os._exit(1)`` from a timer thread (no goodbye: as an NCCL watchdog abort or an OOM kill
ends a process); 0: the job waits for its launcher to tear it down.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import trainwarden.agent as tw


def main(run: str, fault: str, at: int, exit_after: float) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    tw.init(run=run, flush_interval_s=0.2, heartbeat_s=0.5)
    dist.init_process_group("gloo")
    steps = at + 400
    for step in range(steps):
        with tw.step(step):
            if step == at and exit_after > 0:
                threading.Timer(exit_after, os._exit, (1,)).start()
            if step == at and fault == "hang" and rank == 2:
                time.sleep(3600)
            if step == at and fault == "desync" and rank == 1:
                out = [torch.zeros(4) for _ in range(dist.get_world_size())]
                dist.all_gather(out, torch.ones(4))
            else:
                dist.all_reduce(torch.ones(4))
            time.sleep(0.02)
    tw.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
