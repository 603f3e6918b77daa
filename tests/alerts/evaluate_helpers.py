"""Hand-built snapshots of one run for the rule-kind tests (``test_evaluate_*.py``).

The snapshots are a realistic run (four ranks on two nodes, a step a second, GPU samples
every 5 s) that each test bends where its rule looks; the run-level rollups are computed
from the rank rows with ``collector/rollups/aggregate.py``, as the collector stores them.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

from trainwarden.agent.gpu import describe_xid
from trainwarden.alerts import Rule, load_rule_packs, parse_rule
from trainwarden.alerts.metrics import METRICS
from trainwarden.alerts.snapshot import RankInfo, Snapshot, StatRow, Verdict
from trainwarden.collector.store import models

PACK = {rule.name: rule for rule in load_rule_packs()}


RUN = "gpt-7b"


T0 = 1_700_000_000.0  # when step 0 started


STEP_S = 1.0


PEAK = 989e12  # H100 SXM BF16 dense peak FLOP/s


FLOPS = 0.4 * PEAK * STEP_S  # per rank and step: 40 % MFU at the healthy step time


STEP_COLUMNS = [c.name for c in models.rank_steps.columns]


GPU_COLUMNS = [c.name for c in models.gpu_samples.columns]


Vary = Callable[[int, int], dict[str, Any]]


_ids = itertools.count(1)


def ts_of(step: int) -> float:
    return T0 + step * STEP_S


def step_row(rank: int, step: int, **cols: Any) -> dict[str, Any]:
    """A ``rank_steps`` row of a healthy rank; each data shard gives a slightly different loss."""
    row: dict[str, Any] = dict.fromkeys(STEP_COLUMNS)
    row.update(
        run_id=1,
        rank=rank,
        step=step,
        ts=ts_of(step),
        recv_ts=ts_of(step) + 1.5,
        duration_s=STEP_S,
        data_wait_s=0.01,
        tokens=4096,
        loss=2.0 + 0.004 * rank,
        fwd_s=0.25,
        bwd_s=0.5,
        opt_s=0.05,
        compute_s=0.8,
        exposed_comm_s=0.1,
        overlapped_comm_s=0.3,
        idle_s=0.0,
        grad_norm=1.0,
        flops=FLOPS,
        peak_flops=PEAK,
    )
    row.update(cols)
    if "mfu" not in cols:
        row["mfu"] = row["flops"] / (row["duration_s"] * row["peak_flops"])
    return row


def gpu_row(rank: int, ts: float, **readings: Any) -> dict[str, Any]:
    """A ``gpu_samples`` row of a busy, cool, healthy GPU."""
    row: dict[str, Any] = dict.fromkeys(GPU_COLUMNS)
    row.update(
        run_id=1,
        rank=rank,
        ts=ts,
        recv_ts=ts + 0.5,
        gpu_name="NVIDIA H100 80GB HBM3",
        temp_c=68.0,
        power_w=640.0,
        power_limit_w=700.0,
        util_gpu=97.0,
        util_mem=60.0,
        ecc_corrected=0,
        ecc_uncorrected=0,
        throttle=[],
        simulated=0,
    )
    row.update(readings)
    return row


def rollup(rows: Sequence[dict[str, Any]]) -> dict[str, list[StatRow]]:
    """``step_stats`` of ``rows``: per metric and step, min / median / max / mean / total."""
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        by_step[row["step"]].append(row)
    stats: dict[str, list[StatRow]] = defaultdict(list)
    for step in sorted(by_step):
        group = by_step[step]
        for name, metric in METRICS.items():
            values = [v for v in map(metric.value, group) if v is not None]
            if values:
                stats[name].append(
                    StatRow(
                        step,
                        min(r["ts"] for r in group),
                        {
                            "min": min(values),
                            "median": statistics.median(values),
                            "max": max(values),
                            "mean": statistics.fmean(values),
                            "total": metric.total(group),
                        },
                    )
                )
    return dict(stats)


def bend(
    *,
    since: int = 0,
    ranks: Collection[int] | None = None,
    steps: Collection[int] | None = None,
    **cols: Any,
) -> Vary:
    """A ``vary`` that sets ``cols`` on ``ranks`` (all) at ``steps`` (all) from step ``since``."""

    def vary(rank: int, step: int) -> dict[str, Any]:
        hit = (
            step >= since and (ranks is None or rank in ranks) and (steps is None or step in steps)
        )
        return cols if hit else {}

    return vary


def run(
    *,
    last: int = 400,
    first: int = 0,
    world: int = 4,
    vary: Vary | None = None,
    gpu: Vary | None = None,
    **fields: Any,
) -> Snapshot:
    """A healthy run just after step ``last`` arrived (at its ts + 1.5 s). ``vary(rank, step)``
    changes rank rows, ``gpu(rank, age_s)`` GPU samples; ``fields`` replace the snapshot's."""
    rows = [
        step_row(rank, step, **(vary(rank, step) if vary else {}))
        for step in range(first, last + 1)
        for rank in range(world)
    ]
    now = ts_of(last) + 2.0
    ranks = {
        r: RankInfo(
            r,
            node=f"node{r // 2}",
            gpu=str(r % 2),
            last_seen=now - 0.5,
            heartbeat_s=2.0,
            progress_at=now - 1.0,
            last_step=last,
        )
        for r in range(world)
    }
    samples = [
        gpu_row(r, now - age, **(gpu(r, age) if gpu else {}))
        for age in range(115, -1, -5)
        for r in range(world)
    ]
    snap = Snapshot(
        run=RUN,
        now=now,
        last_step=last,
        first_step=first,
        started_at=ts_of(first) - 60,
        ranks=ranks,
        stats=rollup(rows),
        steps=rows,
        marked=[r for r in rows if r["flags"] or r["issues"]],
        gpu=samples,
        last_event={"checkpoint": now - 900},
        median_step_s=STEP_S,
    )
    return replace(snap, **fields)


def with_ranks(snap: Snapshot, **changes: dict[str, Any]) -> Snapshot:
    """``snap`` with rank ``rN``'s info changed: ``with_ranks(s, r2={"state": "hung"})``."""
    ranks = dict(snap.ranks)
    for key, change in changes.items():
        rank = int(key[1:])
        ranks[rank] = replace(ranks[rank], **change)
    return replace(snap, ranks=ranks)


def event(
    kind: str, rank: int | None, *, at: float, step: int | None = 400, **data: Any
) -> dict[str, Any]:
    """An ``events`` row that happened at ``at`` and arrived half a second later."""
    return {
        "id": next(_ids),
        "kind": kind,
        "rank": rank,
        "step": step,
        "ts": at,
        "recv_ts": at + 0.5,
        "data": data,
    }


def xid(rank: int, code: int, *, at: float, step: int = 400) -> dict[str, Any]:
    """An XID as the agent reports it: the code and the catalog's entry."""
    return event("xid", rank, at=at, step=step, code=code, **describe_xid(code))


def custom(kind: str, params: dict[str, Any], **fields: Any) -> Rule:
    """A user's own rule of ``kind``."""
    return parse_rule(
        {
            "name": "Custom",
            "kind": kind,
            "summary": "A user's rule.",
            "severity": "warning",
            "runbook": "LowMFU.md",
            "params": params,
            **fields,
        }
    )


def only(verdicts: list[Verdict]) -> Verdict:
    assert len(verdicts) == 1, verdicts
    return verdicts[0]


def _straggling(rank: int, step: int) -> dict[str, Any]:
    """Rank 2 computes 1.5x longer; the others finish early and wait in the all-reduce."""
    if rank == 2:
        return {"compute_s": 1.2, "exposed_comm_s": 0.05, "duration_s": 1.35}
    return {"compute_s": 0.8, "exposed_comm_s": 0.5, "duration_s": 1.35}
