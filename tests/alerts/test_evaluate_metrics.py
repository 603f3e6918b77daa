"""The metric rule kinds (threshold, baseline, peer: ``alerts/evaluate_metrics.py``) over
hand-built snapshots of one run: performance, loss and divergence rules and users' own
metric rules; what fires, on which rank, and what does not (``evaluate_helpers.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from trainwarden.alerts.evaluate import evaluate

from .evaluate_helpers import PACK, Vary, _straggling, bend, custom, only, run, step_row, with_ranks

# -- performance ---------------------------------------------------------------------------


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
