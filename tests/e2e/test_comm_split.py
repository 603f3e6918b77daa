"""The always-on communication split on 2 real gloo ranks.

A user's DDP comm hook (registered after tw.watch, so chained inside the agent's)
delays the completion of the last gradient bucket by X ms on odd steps only. The
exposed communication the agent measures must grow by X on odd steps, and compute
must not.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ..conftest import ROOT, free_port

DELAYS_MS = [20, 50, 100]
STEPS = 30
WARMUP = 4


def median_ms(block: list[dict], key: str, parity: int) -> float:
    return statistics.median(s[key] for s in block if s["step"] % 2 == parity) * 1000


def test_exposed_comm_tracks_an_injected_delay(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.e2e.comm_worker",
                str(tmp_path),
                ",".join(map(str, DELAYS_MS)),
                str(STEPS),
            ],
            cwd=ROOT,
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]

    for rank in range(2):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(steps) == STEPS * len(DELAYS_MS)
        assert {s["comm_source"] for s in steps} == {"hook"}
        for i, delay in enumerate(DELAYS_MS):
            block = [s for s in steps if i * STEPS + WARMUP <= s["step"] < (i + 1) * STEPS]
            d_exposed = median_ms(block, "exposed_comm_s", 1) - median_ms(
                block, "exposed_comm_s", 0
            )
            d_compute = median_ms(block, "compute_s", 1) - median_ms(block, "compute_s", 0)
            print(
                f"rank {rank} X={delay} ms: Δexposed {d_exposed:.1f} ms, Δcompute {d_compute:.1f} ms"
            )
            assert abs(d_exposed - delay) <= 10, (rank, delay, d_exposed)
            assert abs(d_compute) <= 10, (rank, delay, d_compute)
            # Phases cover the step, and the split adds up to it.
            for s in block:
                phases = s["fwd_s"] + s["bwd_s"] + s["opt_s"] + s["other_s"]
                assert abs(phases - s["duration_s"]) < 1e-6
                assert abs(s["compute_s"] + s["exposed_comm_s"] - s["duration_s"]) < 1e-6
                assert s["overlapped_comm_s"] >= 0
