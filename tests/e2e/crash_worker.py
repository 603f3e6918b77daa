"""One gloo rank of the crash experiment (run by tests/e2e/test_last_words.py under torchrun).

Every rank all-reduces a tensor of 1,024 floats each step; at step ``at`` the ``culprit``
all-reduces one of 8: gloo, receiving more than it expects, throws from its own thread
and ``std::terminate`` aborts the culprit (SIGABRT); the others get "Connection closed by
peer" and exit through the agent's shutdown (or torchrun's SIGTERM).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import trainwarden.agent as tw


def main(run: str, culprit: int, at: int) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    tw.init(run=run, flush_interval_s=0.2)
    dist.init_process_group("gloo")
    for step in range(at + 50):
        with tw.step(step):
            size = 8 if (rank == culprit and step == at) else 1024
            dist.all_reduce(torch.ones(size))  # the culprit's frame the stack must show
            time.sleep(0.05)
    tw.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
