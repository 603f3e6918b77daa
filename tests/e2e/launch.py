"""Launching trainers as a user would: torchrun's command line."""

from __future__ import annotations

import sys


def torchrun(nproc: int, *target: str, restarts: int = 0) -> list[str]:
    """``torchrun --standalone --nproc-per-node N [--max-restarts R] <target...>``: a
    script path, or ``-m module``, and its arguments."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(restarts),
        "--monitor-interval",
        "0.2",
        *target,
    ]
