"""Issue 35's coverage proof: 4 gloo ranks under torchrun train one epoch over a
10,000-sample dataset through ``tw.watch_loader`` with a sampler that repeats 1 % and
drops 1 % of the samples: the collector counts exactly 100 repeated and 100 missing,
names them, and DataDuplicated and DataSkipped fire; the clean epochs after it count
every sample once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from ..helpers import start_serve, stop_serve, wait_for
from .launch import torchrun

WORKER = Path(__file__).with_name("coverage_worker.py")


def buggy_epoch_0() -> tuple[set[int], set[int]]:
    """The repeated and the missing ids of the worker's epoch 0, from its own rule."""
    order = torch.randperm(10_000, generator=torch.Generator().manual_seed(0)).tolist()
    return {order[p - 1] for p in range(50, 10_000, 100)}, {
        order[p] for p in range(50, 10_000, 100)
    }


def test_an_epoch_with_a_buggy_sampler_is_counted_exactly(tmp_path: Path) -> None:
    server = start_serve(f"sqlite:///{tmp_path / 'cov.db'}", tmp_path / "serve.log")
    run = "coverage4"
    cmd = torchrun(
        4,
        str(WORKER),
        "--run-name",
        run,
        "--url",
        server.url,
        "--epochs",
        "3",  # on long enough after epoch 0 for the evaluator's and alert engine's passes
        "--work-ms",
        "15",
    )
    log = tmp_path / "torchrun.log"
    try:
        with log.open("w") as out:
            done = subprocess.run(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=300,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        assert done.returncode == 0, log.read_text()[-4000:]
        counted = wait_for(
            lambda: (
                len(c := server.get(f"/api/v1/runs/{run}/events", kind="epoch_coverage").json())
                == 3
                and c
            ),
            30,
            "three epochs counted",
        )
        alerts = {a["rule"]: a for a in server.get("/api/v1/alerts", run=run).json()}
        duplicated = server.get(f"/api/v1/runs/{run}/events", kind="data_duplicated").json()
        skipped = server.get(f"/api/v1/runs/{run}/events", kind="data_skipped").json()
    finally:
        stop_serve(server)
    by_epoch = {c["data"]["epoch"]: c["data"] for c in counted}
    first = by_epoch[0]
    assert (first["seen"], first["distinct"], first["duplicated"], first["missing"]) == (
        10_000,
        9_900,
        100,
        100,
    )
    assert first["exact"] is True and first["ranks"] == "0-3" and first["steps"] == [0, 99]
    repeated, missing = buggy_epoch_0()
    assert set(first["missing_examples"]) <= missing and len(first["missing_examples"]) == 10
    assert {e["id"] for e in first["duplicate_examples"]} <= repeated
    for epoch in (1, 2):  # clean epochs: every sample once
        assert (by_epoch[epoch]["distinct"], by_epoch[epoch]["duplicated"]) == (10_000, 0)
        assert by_epoch[epoch]["missing"] == 0
    ((dup,), (skip,)) = duplicated, skipped
    assert (dup["data"]["epoch"], dup["data"]["duplicated"]) == (0, 100)
    assert (skip["data"]["epoch"], skip["data"]["missing"]) == (0, 100)
    assert alerts["DataDuplicated"]["state"] == "firing", alerts
    assert alerts["DataSkipped"]["state"] == "firing", alerts
    assert (
        "100 samples trained on more than once"
        in alerts["DataDuplicated"]["annotations"]["description"]
    )
