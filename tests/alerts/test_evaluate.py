"""Each rule kind over hand-built snapshots of one run: what fires, on which rank, and
what does not; then the lifecycle over a sequence of snapshots, as the engine runs it.

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

import pytest

from trainwarden.agent.gpu import describe_xid
from trainwarden.alerts import Alert, Rule, advance, load_rule_packs, parse_rule
from trainwarden.alerts.evaluate import evaluate
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


# -- a healthy run is quiet ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PACK))
def test_a_healthy_run_fires_no_default_rule(name: str) -> None:
    snap = run()
    # The rollups hold enough history for every baseline (warm-up + baseline + window).
    assert len(snap.stats["mfu"]) == 401
    assert evaluate(PACK[name], snap) == []


# -- performance ---------------------------------------------------------------------------


def _straggling(rank: int, step: int) -> dict[str, Any]:
    """Rank 2 computes 1.5x longer; the others finish early and wait in the all-reduce."""
    if rank == 2:
        return {"compute_s": 1.2, "exposed_comm_s": 0.05, "duration_s": 1.35}
    return {"compute_s": 0.8, "exposed_comm_s": 0.5, "duration_s": 1.35}


def test_straggler_is_the_slow_rank_not_the_ranks_waiting_for_it() -> None:
    v = only(evaluate(PACK["Straggler"], run(first=380, vary=_straggling)))
    assert (v.rank, v.step) == (2, 400)
    assert v.value == pytest.approx(1.2 / 0.8)
    assert "rank 2 (node node1)" in v.detail and "compute" in v.detail


def test_straggler_compares_the_newest_step_that_every_live_rank_reported() -> None:
    snap = run(first=380, vary=_straggling)
    # Step 401 has arrived from ranks 0, 1 and 3 only (rank 2 is behind), and rank 0 was
    # slow on it: not comparable yet, so step 400 decides.
    early = [step_row(r, 401, compute_s=2.0 if r == 0 else 0.8) for r in (0, 1, 3)]
    v = only(evaluate(PACK["Straggler"], replace(snap, steps=snap.steps + early)))
    assert (v.rank, v.step) == (2, 400)


def test_straggler_does_not_wait_for_a_rank_that_finished() -> None:
    snap = run(first=380, vary=bend(ranks={2}, compute_s=1.2))
    # Rank 3 finished at step 390: the newest step with all live ranks is 400.
    snap = replace(snap, steps=[r for r in snap.steps if r["rank"] != 3 or r["step"] <= 390])
    snap = with_ranks(snap, r3={"state": "finished", "last_step": 390})
    v = only(evaluate(PACK["Straggler"], snap))
    assert (v.rank, v.step) == (2, 400)
    assert v.value == pytest.approx(1.5)


def test_low_mfu_fires_when_run_mfu_falls_below_80_percent_of_its_baseline() -> None:
    # From step 351 every step takes 1.4 s for the same FLOPs: MFU 0.40 -> 0.29.
    snap = run(vary=bend(since=351, duration_s=1.4))
    v = only(evaluate(PACK["LowMFU"], snap))
    assert v.rank is None and v.step == 400
    assert v.value == pytest.approx(1 / 1.4)
    assert v.detail.startswith("run: mfu 0.286") and "0.4" in v.detail


def test_low_mfu_does_not_fire_on_a_small_dip() -> None:
    snap = run(vary=bend(since=351, duration_s=1.2))  # 0.83x
    assert evaluate(PACK["LowMFU"], snap) == []


def test_low_mfu_needs_enough_baseline_after_the_warmup() -> None:
    # 350 steps: after the 100 warm-up steps 200 remain before the window, under the
    # quarter of the 1,000-step baseline that the rule needs; 300 would be enough.
    snap = run(last=349, vary=bend(since=300, duration_s=1.4))
    assert evaluate(PACK["LowMFU"], snap) == []
    assert evaluate(PACK["LowMFU"], run(last=399, vary=bend(since=350, duration_s=1.4)))


@pytest.mark.parametrize(("first_step", "fires"), [(0, True), (1000, False), (None, False)])
def test_low_mfu_counts_the_warmup_from_the_runs_first_step(
    first_step: int | None, fires: bool
) -> None:
    # The snapshot holds steps 1000-1349 only; the run itself began at first_step (None:
    # unknown, so the snapshot's first step).
    snap = run(first=1000, last=1349, vary=bend(since=1300, duration_s=1.4))
    verdicts = evaluate(PACK["LowMFU"], replace(snap, first_step=first_step))
    assert bool(verdicts) is fires


def test_step_time_regression_follows_the_slowest_rank() -> None:
    # Only rank 2 slowed down, but the whole job waits for it: the run's step time is its.
    snap = run(vary=bend(ranks={2}, since=351, duration_s=1.3))
    v = only(evaluate(PACK["StepTimeRegression"], snap))
    assert v.rank is None and v.value == pytest.approx(1.3)
    assert "step_time 1.3" in v.detail


def test_step_time_regression_ignores_10_percent() -> None:
    snap = run(vary=bend(since=351, duration_s=1.1))
    assert evaluate(PACK["StepTimeRegression"], snap) == []


def test_high_exposed_comm_uses_the_median_over_its_window() -> None:
    # Exactly the last 50 steps are high (the 51 before them are not).
    last_50 = run(first=300, vary=bend(since=351, exposed_comm_s=0.3))
    v = only(evaluate(PACK["HighExposedComm"], last_50))
    assert v.rank is None and v.value == pytest.approx(0.3)
    assert "exposed_comm_frac 0.3" in v.detail and "50 steps" in v.detail
    # The last 10 steps alone are not the median of 50.
    last_10 = run(first=300, vary=bend(since=391, exposed_comm_s=0.3))
    assert evaluate(PACK["HighExposedComm"], last_10) == []


def test_data_loader_stall_is_a_fraction_of_each_ranks_own_step() -> None:
    def vary(rank: int, step: int) -> dict[str, Any]:
        if rank == 1:  # 0.3 s of a 1.2 s step: 25 %
            return {"data_wait_s": 0.3, "duration_s": 1.2}
        if rank == 3:  # waits longer, 0.35 s, but of a 3.5 s step: 10 %
            return {"data_wait_s": 0.35, "duration_s": 3.5}
        if rank == 0 and step % 10 == 0:  # an eval between steps every 10: not the median
            return {"data_wait_s": 0.9, "duration_s": 1.9}
        return {}

    v = only(evaluate(PACK["DataLoaderStall"], run(first=350, vary=vary)))
    assert (v.rank, v.step) == (1, 400)
    assert v.value == pytest.approx(0.25)
    assert "rank 1" in v.detail and "data_wait / step time 0.25" in v.detail


@pytest.mark.parametrize(
    ("name", "reading", "bad", "says"),
    [
        ("LowGpuUtilization", "util_gpu", 30.0, "util_gpu 30 (median over 1m), threshold < 50"),
        ("GpuOverTemperature", "temp_c", 91.0, "temp_c 91 (median over 1m), threshold > 85"),
        # The latest sample, no window: a GPU reset clears the volatile count.
        ("EccUncorrectable", "ecc_uncorrected", 1, "ecc_uncorrected 1, threshold > 0"),
    ],
)
def test_gpu_thresholds_read_the_recent_samples(
    name: str, reading: str, bad: float, says: str
) -> None:
    def gpu(rank: int, age: int) -> dict[str, Any]:
        if rank == 1 and age < 60:  # bad for the last minute
            return {reading: bad}
        if rank == 2 and age >= 60:  # bad before that, healthy (or reset) since
            return {reading: bad}
        return {}

    v = only(evaluate(PACK[name], run(first=390, gpu=gpu)))
    assert (v.rank, v.step) == (1, 400)
    assert v.value == pytest.approx(bad)
    assert v.detail == f"rank 1 (node node0): {says}"


# -- stability -----------------------------------------------------------------------------


def test_loss_spike_needs_the_loss_doubled_over_its_window() -> None:
    v = only(evaluate(PACK["LossSpike"], run(first=100, vary=bend(since=396, loss=5.0))))
    assert v.rank is None
    assert v.value == pytest.approx(5.0 / 2.006)  # the mean loss of the four shards was 2.006
    assert "loss 5" in v.detail
    # Two spiking steps of five: clipping absorbed it, the median did not move.
    assert evaluate(PACK["LossSpike"], run(first=100, vary=bend(since=399, loss=5.0))) == []


def test_loss_spike_onset_is_where_the_loss_left_its_trend_not_where_a_pass_saw_it() -> None:
    # Fast steps: the loss doubled at step 381 (the update of step 380 was the bad one),
    # and the pass that sees it runs 20 steps later. The onset comes from the data.
    v = only(evaluate(PACK["LossSpike"], run(first=100, vary=bend(since=381, loss=5.0))))
    assert (v.step, v.onset_step) == (400, 381)
    # A step inside the streak that dipped back (noise) does not end it: the window's
    # median over it still holds.
    dip = bend(since=381, loss=5.0)
    noisy = run(first=100, vary=lambda rank, step: {} if step == 390 else dip(rank, step))
    assert only(evaluate(PACK["LossSpike"], noisy)).onset_step == 381
    # Noticed late enough that a third of the baseline is the spike: still step 381.
    late = run(first=100, last=460, vary=bend(since=381, loss=5.0))
    assert only(evaluate(PACK["LossSpike"], late)).onset_step == 381
    # The streak began before the snapshot's oldest step: its oldest spiked step.
    assert (
        only(evaluate(PACK["LossSpike"], run(first=100, vary=bend(since=396, loss=5.0)))).onset_step
        == 396
    )


def test_threshold_onset_is_the_first_step_of_the_streak() -> None:
    rule = custom("threshold", {"scope": "run", "metric": "loss", "stat": "total", "above": 4.0})
    v = only(evaluate(rule, run(first=350, vary=bend(since=371, loss=5.0))))
    assert (v.step, v.onset_step) == (400, 371)


def test_an_event_rule_s_onset_is_the_earliest_matching_step() -> None:
    def vary(rank: int, step: int) -> dict[str, Any]:
        if step in (397, 399) and rank == 2:  # two NaNs arrived in one pass
            return {"loss": None, "issues": {"loss": "nan"}}
        return {}

    v = only(evaluate(PACK["NonFiniteLoss"], run(first=390, vary=vary)))
    assert (v.rank, v.step, v.onset_step) == (2, 399, 397)


def test_rank_loss_divergence_flags_the_rank_that_left_its_peers() -> None:
    snap = run(first=390, vary=bend(ranks={3}, loss=7.5))
    v = only(evaluate(PACK["RankLossDivergence"], snap))
    # losses 2.000, 2.004, 2.008, 7.5: median 2.006, MAD 0.004
    assert (v.rank, v.step) == (3, 400)
    assert v.value == pytest.approx((7.5 - 2.006) / (1.4826 * 0.004))
    assert "rank 3" in v.detail and "loss 7.5" in v.detail


def test_rank_loss_divergence_works_with_three_ranks() -> None:
    snap = run(first=390, world=3, vary=bend(ranks={2}, loss=7.5))
    assert only(evaluate(PACK["RankLossDivergence"], snap)).rank == 2


def test_a_z_score_needs_min_ranks() -> None:
    # With two ranks each is 0.67 robust z from their median: a low bound would fire on
    # both if the rule did not insist on three ranks.
    rule = custom("peer", {"metric": "loss", "z_above": 0.5, "min_ranks": 3})

    def losses(*values: float | None) -> Vary:
        return lambda rank, step: {"loss": values[rank]}

    assert evaluate(rule, run(first=390, world=2, vary=losses(2.0, 7.5))) == []
    assert [
        v.rank for v in evaluate(rule, run(first=390, world=3, vary=losses(2.0, 7.5, 2.0)))
    ] == [1]
    # Three ranks, but one reported a NaN (stored as no value): two losses to compare.
    assert evaluate(rule, run(first=390, world=3, vary=losses(2.0, 7.5, None))) == []


def test_non_finite_loss_fires_while_the_nan_is_fresh() -> None:
    def vary(rank: int, step: int) -> dict[str, Any]:
        if step == 400 and rank == 2:  # as ingest stores it: no value, the fact in issues
            return {"loss": None, "issues": {"loss": "nan"}}
        if step == 400 and rank == 1:  # an Inf grad norm is routine with a GradScaler
            return {"grad_norm": None, "issues": {"grad_norm": "inf"}}
        return {}

    snap = run(first=390, vary=vary)
    v = only(evaluate(PACK["NonFiniteLoss"], snap))
    assert (v.rank, v.step) == (2, 400)
    assert "rank 2" in v.detail and "loss = nan" in v.detail
    # It arrived at ts + 1.5; hold_s (10 s) later it is no longer news.
    arrived = ts_of(400) + 1.5
    assert evaluate(PACK["NonFiniteLoss"], replace(snap, now=arrived + 9.9))
    assert evaluate(PACK["NonFiniteLoss"], replace(snap, now=arrived + 10.0)) == []


@pytest.mark.parametrize(
    ("spikes", "fires"), [((250, 350, 360, 370, 380), False), ((350, 360, 370, 380, 390), True)]
)
def test_grad_norm_spike_burst_counts_a_spike_on_every_rank_once(
    spikes: tuple[int, ...], fires: bool
) -> None:
    # The grad norm is global: every rank flags the same step. Step 250 is outside the
    # 100-step window, so the first case has 4 spikes (16 flagged rows), the second 5.
    vary = bend(steps=set(spikes), flags=["grad_norm_spike"])
    verdicts = evaluate(PACK["GradNormSpikeBurst"], run(first=200, vary=vary))
    if not fires:
        assert verdicts == []
        return
    v = only(verdicts)
    assert v.rank is None and v.value == 5.0
    assert "run: 5 matches within 100 steps" in v.detail


def test_checkpoint_stale_counts_from_the_last_checkpoint() -> None:
    snap = run(first=390)
    stale = replace(snap, last_event={"checkpoint": snap.now - 3 * 3600})
    v = only(evaluate(PACK["CheckpointStale"], stale))
    assert v.rank is None and v.value == pytest.approx(3 * 3600)
    assert "no checkpoint event for 3.0h" in v.detail
    assert (
        evaluate(PACK["CheckpointStale"], replace(snap, last_event={"checkpoint": snap.now - 3600}))
        == []
    )


def test_checkpoint_stale_counts_from_the_start_when_none_was_ever_saved() -> None:
    snap = run(first=390, last_event={})
    v = only(evaluate(PACK["CheckpointStale"], replace(snap, started_at=snap.now - 2.5 * 3600)))
    assert v.value == pytest.approx(2.5 * 3600) and "since the run started" in v.detail
    assert evaluate(PACK["CheckpointStale"], replace(snap, started_at=snap.now - 3600)) == []


def test_checkpoint_stale_is_quiet_once_every_rank_finished() -> None:
    snap = run(first=390, last_event={"checkpoint": T0 - 3 * 3600})
    done = {f"r{r}": {"state": "finished"} for r in snap.ranks}
    assert evaluate(PACK["CheckpointStale"], snap)
    assert evaluate(PACK["CheckpointStale"], with_ranks(snap, **done)) == []


# -- hardware ------------------------------------------------------------------------------


def test_gpu_thermal_throttle_reads_the_newest_sample_of_each_rank() -> None:
    def gpu(rank: int, age: int) -> dict[str, Any]:
        if rank == 0 and age > 10:  # was throttled, is not any more
            return {"throttle": ["hw_thermal"], "temp_c": 92.0}
        if rank == 1:
            return {"throttle": ["sw_power_cap", "sw_thermal"], "temp_c": 87.0}
        if rank == 2:  # at its power limit: normal
            return {"throttle": ["sw_power_cap"]}
        return {}

    v = only(evaluate(PACK["GpuThermalThrottle"], run(first=390, gpu=gpu)))
    assert v.rank == 1 and v.value == pytest.approx(87.0)
    assert "rank 1" in v.detail and "sw_thermal" in v.detail and "sw_power_cap" not in v.detail


def test_fatal_xid_follows_the_catalogs_action() -> None:
    snap = run(first=390)
    at = snap.now - 1.0
    events = [xid(0, 31, at=at), xid(1, 79, at=at), xid(2, 48, at=at), xid(3, 13, at=at)]
    verdicts = sorted(
        evaluate(PACK["FatalXid"], replace(snap, events=events)), key=lambda v: v.rank or 0
    )
    assert [v.rank for v in verdicts] == [1, 2]  # 79 drain, 48 reset_gpu; not 13, 31 (restart_app)
    assert "rank 1 (node node0)" in verdicts[0].detail and "XID 79" in verdicts[0].detail
    assert "XID 48" in verdicts[1].detail and "Double Bit ECC Error" in verdicts[1].detail


def test_fatal_xid_holds_only_while_fresh() -> None:
    snap = run(first=390)
    old = replace(snap, events=[xid(1, 79, at=snap.now - 11.0)])  # arrived 10.5 s ago
    assert evaluate(PACK["FatalXid"], old) == []


# -- liveness ------------------------------------------------------------------------------


def test_rank_hung_pages_for_the_culprit_only() -> None:
    snap = run(first=390)
    victim = {"state": "hung", "role": "victim"}
    hung = with_ranks(
        snap,
        r0=victim,
        r1=victim,
        r2={"state": "hung", "role": "culprit", "last_step": 397},
        r3=victim,
    )
    v = only(evaluate(PACK["RankHung"], hung))
    assert (v.rank, v.step, v.value) == (2, 397, None)
    assert v.detail == "rank 2 (node node1) is hung (culprit)"
    slow = with_ranks(snap, r2={"state": "slow", "role": "culprit"})
    assert evaluate(PACK["RankHung"], slow) == []


def test_rank_dead_after_two_and_a_quarter_heartbeats() -> None:
    snap = run(first=390)
    now = snap.now
    snap = with_ranks(
        snap,
        r1={"last_seen": now - 5.0},  # 5 s > 2.25 x 2 s
        r2={"last_seen": now - 20.0, "heartbeat_s": 10.0},  # 20 s < 2.25 x 10 s
        r3={"last_seen": now - 100.0, "state": "finished"},  # said goodbye
    )
    v = only(evaluate(PACK["RankDead"], snap))
    assert v.rank == 1 and v.value == pytest.approx(5.0)
    assert "rank 1" in v.detail and "no heartbeat for 5.0s" in v.detail
    failed = with_ranks(snap, r1={"state": "failed"})
    assert evaluate(PACK["RankDead"], failed) == []
    # The collector's own ingest lag is not the rank's fault.
    assert evaluate(PACK["RankDead"], replace(snap, lag_s=1.0)) == []
    # ... but once the rank was declared dead and nothing came from it since, a lag that
    # grew does not bring it back (the alert would resolve and page again).
    declared = with_ranks(snap, r1={"state": "dead", "state_since": now - 0.5})
    assert only(evaluate(PACK["RankDead"], replace(declared, lag_s=1.0))).rank == 1
    heard = with_ranks(snap, r1={"state": "dead", "state_since": now - 5.5})
    assert evaluate(PACK["RankDead"], replace(heard, lag_s=1.0)) == []  # heard since


def test_rank_dead_carries_the_hung_collective_verdict_of_a_dead_culprit() -> None:
    # The survivors wait in a collective the dead rank never entered: they are victims (no
    # RankHung), so the page that says so is RankDead's.
    snap = run(first=390)
    verdict = "rank 1 (node node0) is dead (no heartbeats) and never entered all_reduce #40"
    dead = with_ranks(
        snap,
        r0={"state": "hung", "role": "victim", "collective": verdict},
        r1={"state": "dead", "role": "culprit", "collective": verdict, "last_seen": snap.now - 9},
    )
    v = only(evaluate(PACK["RankDead"], dead))
    assert v.rank == 1 and v.annotations == {"collective": verdict}
    assert v.detail.endswith(f"(allowed 2.25 beats, 4.5s): {verdict}")
    assert evaluate(PACK["RankHung"], dead) == []
    # Without a verdict: no annotation of its own.
    plain = only(evaluate(PACK["RankDead"], with_ranks(dead, r1={"collective": None})))
    assert plain.annotations is None and plain.detail.endswith("4.5s)")


# -- users' own rules: the other options of each kind -------------------------------------


def test_threshold_below_per_rank() -> None:
    rule = custom(
        "threshold",
        {"scope": "rank", "metric": "tokens_per_s", "window": "10 steps", "below": 3000},
    )
    snap = run(first=380, vary=bend(ranks={1}, duration_s=2.0))
    v = only(evaluate(rule, snap))
    assert v.rank == 1 and v.value == pytest.approx(2048.0)
    assert "rank 1" in v.detail and "tokens_per_s" in v.detail


def test_baseline_ratio_above_per_rank() -> None:
    rule = custom(
        "baseline",
        {
            "scope": "rank",
            "metric": "step_time",
            "window": "10 steps",
            "baseline": "100 steps",
            "ratio_above": 1.5,
        },
    )
    snap = run(first=280, vary=bend(ranks={3}, since=391, duration_s=2.0))
    v = only(evaluate(rule, snap))
    assert (v.rank, v.step) == (3, 400)
    assert v.value == pytest.approx(2.0)
    assert "rank 3 (node node1)" in v.detail and "step_time 2" in v.detail


def test_peer_ratio_below() -> None:
    rule = custom("peer", {"metric": "tokens_per_s", "ratio_below": 0.5})
    snap = run(first=390, vary=bend(ranks={0}, tokens=1024))
    v = only(evaluate(rule, snap))
    assert v.rank == 0 and v.value == pytest.approx(0.25)
    assert "rank 0" in v.detail and "tokens_per_s" in v.detail


def test_rate_per_rank_over_a_time_window() -> None:
    rule = custom(
        "rate",
        {
            "count": {"match": "xid", "codes": [13, 31, 43]},
            "window": "10m",
            "at_least": 3,
            "per": "rank",
        },
    )
    snap = run(first=390)
    now = snap.now
    events = sorted(
        [xid(1, 13, at=now - age) for age in (500, 200, 30)]  # three within 10 minutes
        + [xid(2, 31, at=now - age) for age in (700, 200, 30)],  # one of them earlier
        key=lambda e: e["ts"],
    )
    v = only(evaluate(rule, replace(snap, events=events)))
    assert v.rank == 1 and v.value == 3.0
    assert "rank 1" in v.detail and "3 matches within 10m" in v.detail


def test_rate_per_run_counts_each_event_even_at_one_step() -> None:
    # After an XID 79 the job stops advancing: every later XID carries the same last step.
    rule = custom(
        "rate", {"count": {"match": "xid", "codes": [79]}, "window": "10m", "at_least": 3}
    )
    snap = run(first=390)
    events = [xid(rank, 79, at=snap.now - 60 + rank, step=400) for rank in (0, 1, 2)]
    v = only(evaluate(rule, replace(snap, events=events)))
    assert v.rank is None and v.value == 3.0


def test_rate_per_rank_over_event_kinds_counts_each_ranks_own() -> None:
    rule = custom(
        "rate",
        {
            "count": {"match": "event", "events": ["oom_retry"]},
            "window": "10m",
            "at_least": 2,
            "per": "rank",
        },
    )
    snap = run(first=390)
    events = [
        event("oom_retry", rank, at=snap.now - age) for rank, age in ((1, 300), (2, 200), (1, 100))
    ]
    v = only(evaluate(rule, replace(snap, events=events)))
    assert v.rank == 1 and v.value == 2.0


def test_event_kind_is_a_run_alert_that_names_the_rank() -> None:
    rule = custom("event", {"match": "event", "events": ["restart"]})
    snap = run(first=390)
    events = [event("restart", 3, at=snap.now - 2), event("checkpoint", 0, at=snap.now - 1)]
    v = only(evaluate(rule, replace(snap, events=events)))
    assert v.rank is None and v.step == 400
    assert v.detail == "run: event restart on rank 3"
    stale = [event("restart", 3, at=snap.now - 30)]
    assert evaluate(rule, replace(snap, events=stale)) == []


def test_an_event_of_an_attempt_that_ended_opens_no_alert_once_the_job_is_back() -> None:
    """The job restarted 3 s ago: an event sent 5 s ago (by a process of the attempt that
    ended, still within the hold) speaks of a rank that may be on another node now."""
    rule = custom("event", {"match": "event", "events": ["replica_divergence"], "per_rank": True})
    snap = run(first=390)
    old = [event("replica_divergence", 2, at=snap.now - 5)]
    assert only(evaluate(rule, replace(snap, events=old))).rank == 2
    back = replace(snap, attempt_started_at=snap.now - 3)
    assert evaluate(rule, replace(back, events=old)) == []
    new = [*old, event("replica_divergence", 2, at=snap.now - 1)]
    assert only(evaluate(rule, replace(back, events=new))).rank == 2
    # A check of the ended attempt's step decided only after the restart: stored now, but
    # it says when its step ran.
    late = [event("replica_divergence", 2, at=snap.now - 1, ran_at=snap.now - 6)]
    assert evaluate(rule, replace(back, events=late)) == []


def test_absence_of_progress_in_median_step_times() -> None:
    rule = custom("absence", {"signal": "progress", "after": "10 steps"})
    snap = run(first=390, median_step_s=2.0)  # 10 steps: 20 s
    now = snap.now
    snap = with_ranks(
        snap,
        r1={"progress_at": now - 25.0},
        r2={"progress_at": None, "last_seen": now - 30.0},  # never finished a step: since last seen
        r3={"progress_at": now - 1000.0, "state": "finished"},
    )
    verdicts = sorted(evaluate(rule, snap), key=lambda v: v.rank or 0)
    assert [(v.rank, v.value) for v in verdicts] == [
        (1, pytest.approx(25.0)),
        (2, pytest.approx(30.0)),
    ]
    assert "rank 1" in verdicts[0].detail and "no completed step for 25.0s" in verdicts[0].detail
    # No step time known yet: nothing to count steps by.
    assert evaluate(rule, replace(snap, median_step_s=None)) == []
    # A floor under the relative bound.
    floored = custom("absence", {"signal": "progress", "after": "10 steps", "at_least": "1m"})
    assert evaluate(floored, snap) == []


# -- the lifecycle over a sequence of snapshots --------------------------------------------


def states(rule: Rule, snaps: Sequence[Snapshot], rank: int | None) -> list[str]:
    """The alert of ``rule`` on ``rank`` after each snapshot, as the engine advances it:
    active when a verdict names that rank (None: the run)."""
    labels = {"run": RUN} | ({} if rank is None else {"rank": str(rank)})
    alert = Alert(rule.name, labels)
    out = []
    for snap in snaps:
        active = any(v.rank == rank for v in evaluate(rule, snap))
        alert = advance(
            alert,
            active=active,
            now=snap.now,
            step=snap.last_step,
            for_=rule.for_,
            keep_firing_for=rule.keep_firing_for,
        )
        out.append(alert.state)
    return out


def test_straggler_pages_after_20_slow_steps_and_resolves_when_it_catches_up() -> None:
    def at(last: int, slow: bool) -> Snapshot:
        return run(first=last - 5, last=last, vary=_straggling if slow else None)

    steps = [(400, True), (410, True), (420, True), (430, True), (440, False)]
    assert states(PACK["Straggler"], [at(s, slow) for s, slow in steps], 2) == [
        "pending",
        "pending",
        "firing",
        "firing",
        "resolved",
    ]
    # A rank that recovers for a moment starts counting again.
    steps = [(400, True), (410, True), (415, False), (420, True), (439, True), (440, True)]
    assert states(PACK["Straggler"], [at(s, slow) for s, slow in steps], 2) == [
        "pending",
        "pending",
        "inactive",
        "pending",
        "pending",
        "firing",
    ]


def test_step_time_regression_waits_10_steps() -> None:
    def at(last: int) -> Snapshot:
        return run(last=last, vary=bend(since=351, duration_s=1.5))

    assert states(PACK["StepTimeRegression"], [at(s) for s in (400, 405, 410)], None) == [
        "pending",
        "pending",
        "firing",
    ]


def test_gpu_over_temperature_pages_after_5_minutes_hot() -> None:
    def at(minute: int, hot: bool) -> Snapshot:
        last = 400 + 60 * minute
        return run(first=last - 5, last=last, gpu=bend(ranks={0}, temp_c=90.0) if hot else None)

    minutes = [(0, True), (2, True), (4, True), (5, True), (6, False)]
    assert states(PACK["GpuOverTemperature"], [at(m, hot) for m, hot in minutes], 0) == [
        "pending",
        "pending",
        "pending",
        "firing",
        "resolved",
    ]


def test_rank_hung_for_less_than_a_minute_never_pages() -> None:
    def at(seconds: int, hung: bool) -> Snapshot:
        snap = run(first=395, last=400 + seconds)
        return with_ranks(snap, r2={"state": "hung", "role": "culprit"}) if hung else snap

    assert states(
        PACK["RankHung"], [at(0, True), at(30, True), at(50, False), at(120, False)], 2
    ) == [
        "pending",
        "pending",
        "inactive",
        "inactive",
    ]
    assert states(PACK["RankHung"], [at(0, True), at(30, True), at(60, True)], 2)[-1] == "firing"


def test_non_finite_loss_keeps_firing_for_10_minutes_after_the_nan() -> None:
    snap = run(first=390, vary=bend(ranks={2}, steps={400}, loss=None, issues={"loss": "nan"}))
    later = [replace(snap, now=snap.now + dt) for dt in (0, 20, 600, 619, 620)]
    # The NaN is news for 10 s; the alert is kept 10 minutes from then (cleared at +20).
    assert states(PACK["NonFiniteLoss"], later, 2) == [
        "firing",
        "firing",
        "firing",
        "firing",
        "resolved",
    ]


# -- economics -------------------------------------------------------------------------------


def test_checkpoint_cadence_fires_when_the_interval_is_more_than_2x_off() -> None:
    rule = PACK["CheckpointCadence"]
    advice = {
        "checkpoints": 5,
        "cost_s": 20.0,
        "mtbf_s": 25_000.0,
        "optimal_interval_s": 1000.0,
        "waste_now": 0.16,
        "waste_optimal": 0.04,
    }
    rare = run()
    rare.cadence = {**advice, "interval_s": 7200.0, "ratio": 7.2}
    v = only(evaluate(rule, rare))
    assert v.rank is None and v.value == pytest.approx(7.2)
    assert "every 2.0h" in v.detail and "is 16.7m" in v.detail and "save more often" in v.detail
    often = run()
    often.cadence = {**advice, "interval_s": 300.0, "ratio": 0.3}
    assert "save less often" in only(evaluate(rule, often)).detail
    for quiet in (
        {**advice, "interval_s": 1900.0, "ratio": 1.9},  # within 2x
        {**advice, "interval_s": 7200.0, "ratio": 7.2, "checkpoints": 2},  # too few yet
        {**advice, "interval_s": None, "ratio": None},
        None,
        # 7x too often, but a save costs next to nothing: 0.3 % wasted now
        # against 0.1 % at T* would gain 0.2 % (under min_saving, 0.5 %).
        {
            **advice,
            "interval_s": 15.0,
            "ratio": 0.14,
            "cost_s": 0.05,
            "waste_now": 0.003,
            "waste_optimal": 0.001,
        },
    ):
        snap = run()
        snap.cadence = quiet
        assert evaluate(rule, snap) == []
    # The same gain over min_saving fires.
    pricey = run()
    pricey.cadence = {
        **advice,
        "interval_s": 15.0,
        "ratio": 0.14,
        "waste_now": 0.009,
        "waste_optimal": 0.001,
    }
    assert "save less often" in only(evaluate(rule, pricey)).detail
