"""torchtitan observed by trainwarden, on CUDA GPUs (issue 54): run under torchrun from a
torchtitan 0.3 checkout (its tokenizer and ``c4_test`` dataset are repo-relative test
assets, no download), with torchtitan's own arguments:

    cd $TORCHTITAN_SRC && torchrun --nproc-per-node N .../bench/torchtitan_check.py \\
        --module llama3 --config llama3_debugmodel --training.steps 50 OUT_DIR

It builds the Trainer with ``tw_torchtitan.build_trainer`` (the agent sending to a file a
rank, ``OUT_DIR/rank-R.jsonl``, no collector needed), trains, and on rank 0 checks:

- every rank's steps 1..50 arrived, each with its loss and gradient norm;
- trainwarden's MFU against the MFU torchtitan logs for the same step: compared as
  achieved FLOP/s (MFU x the peak each used: their peak tables may differ), median
  ratio within 10 %.

Exit 0 when both hold. ``scripts/gpu_check.sh`` runs it where ``TORCHTITAN_SRC`` is set.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger

from trainwarden.agent.integrations import torchtitan as tw_torchtitan
from trainwarden.agent.wire import dumps


class FileTransport:
    """What the agent sends, one JSON line a request."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")

    def send(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.file.write(dumps(body).decode() + "\n")
        self.file.flush()
        return {"accepted_steps": len(body["steps"]), "accepted_events": len(body["events"])}

    def close(self) -> None:
        self.file.close()


def main() -> int:
    out = Path(sys.argv.pop())
    out.mkdir(parents=True, exist_ok=True)
    init_logger()
    config = ConfigManager().parse_args()
    rank = int(os.environ.get("RANK", "0"))
    transport = FileTransport(out / f"rank-{rank}.jsonl")
    trainer = tw_torchtitan.build_trainer(
        config, run="torchtitan-check", transport=transport, profile_every=0
    )
    logged: dict[int, float] = {}  # torchtitan's MFU (%) of each logged step
    peak = {"torchtitan": float(trainer.metrics_processor.gpu_peak_flops)}
    log = trainer.metrics_processor.logger.log

    def keep(metrics: dict[str, Any], step: int) -> None:
        if "mfu(%)" in metrics:
            logged[step] = float(metrics["mfu(%)"])
        log(metrics, step)

    trainer.metrics_processor.logger.log = keep
    try:
        trainer.train()
    finally:
        trainer.close()
    import trainwarden.agent as tw

    tw.shutdown()
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, logged)
    dist.barrier()
    status = 0
    if rank == 0:
        status = check(out, world, int(config.training.steps), gathered[0], peak)
    dist.destroy_process_group()
    return status


def check(
    out: Path, world: int, steps: int, logged: dict[int, float], peak: dict[str, float]
) -> int:
    ok = True
    mine: dict[int, list[float]] = {}
    for r in range(world):
        rows = [s for line in (out / f"rank-{r}.jsonl").open() for s in json.loads(line)["steps"]]
        got = sorted(s["step"] for s in rows)
        full = got == list(range(1, steps + 1))
        losses = all(s.get("loss") is not None and s.get("grad_norm") is not None for s in rows)
        print(f"rank {r}: steps {got[:3]}..{got[-3:]} ({len(got)}), loss and norm each: {losses}")
        ok &= full and losses
        for s in rows:
            if s.get("mfu") is not None:
                peak["trainwarden"] = float(s["peak_flops"])
                mine.setdefault(s["step"], []).append(float(s["mfu"]))
    ratios = []
    for step, pct in sorted(logged.items()):
        if step in mine and step > 2 and pct > 0:  # the first steps compile and warm up
            achieved = statistics.median(mine[step]) * peak["trainwarden"]
            ratios.append(achieved / (pct / 100 * peak["torchtitan"]))
    print(f"peaks: {peak}; steps compared: {len(ratios)}")
    if ratios:
        median = statistics.median(ratios)
        print(f"trainwarden / torchtitan achieved FLOP/s, median over steps: {median:.3f}")
        ok &= abs(median - 1) <= 0.10
    else:
        ok = False
    print("torchtitan check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    torch.set_float32_matmul_precision("high")
    sys.exit(main())
