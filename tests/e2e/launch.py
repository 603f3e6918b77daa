"""Launching trainers as a user would: torchrun's command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


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


def run_example(
    example: Path,
    server_url: str,
    run: str,
    out: Path,
    log: Path,
    *,
    drill: str,
    steps: int,
    restarts: int = 0,
    env: dict[str, str] | None = None,
    timeout_s: float = 420,
) -> int:
    """One of ``examples/``'s trainers under torchrun with 2 ranks, as a user runs it (the
    collector's URL and the run's name in the environment), with a fault ``drill``; its
    output in ``log``; returns torchrun's exit code."""
    cmd = torchrun(
        2,
        str(example),
        "--output-dir",
        str(out),
        "--steps",
        str(steps),
        "--save-steps",
        "10",
        "--work-ms",
        "15",  # 40-50 ms steps: time for the collector's rollback round trips
        restarts=restarts,
    )
    environ = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_URL": server_url,
        "TRAINWARDEN_RUN": run,
        "TRAINWARDEN_DRILL": drill,
        "TRAINWARDEN_FLUSH_INTERVAL": "0.5",
        "TRAINWARDEN_PROFILE_EVERY": "0",
        **(env or {}),
    }
    with log.open("w") as out_file:
        return subprocess.run(
            cmd, stdout=out_file, stderr=subprocess.STDOUT, env=environ, timeout=timeout_s
        ).returncode
