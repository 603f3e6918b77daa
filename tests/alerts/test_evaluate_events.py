"""The record rule kinds (event, rate, absence, cadence: ``alerts/evaluate_events.py``)
over hand-built snapshots of one run: NaNs, spike bursts, checkpoints, XIDs, throttling,
hung and dead ranks, and users' own record rules (``evaluate_helpers.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from trainwarden.alerts.evaluate import evaluate

from .evaluate_helpers import PACK, T0, bend, custom, event, only, run, ts_of, with_ranks, xid

# -- stability -----------------------------------------------------------------------------


def test_an_event_rule_s_onset_is_the_earliest_matching_step() -> None:
    def vary(rank: int, step: int) -> dict[str, Any]:
        if step in (397, 399) and rank == 2:  # two NaNs arrived in one pass
            return {"loss": None, "issues": {"loss": "nan"}}
        return {}

    v = only(evaluate(PACK["NonFiniteLoss"], run(first=390, vary=vary)))
    assert (v.rank, v.step, v.onset_step) == (2, 399, 397)


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
