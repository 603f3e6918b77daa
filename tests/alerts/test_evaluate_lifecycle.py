"""Every default rule is quiet on a healthy run; then the lifecycle (``for``,
``keep_firing_for``: ``alerts/lifecycle.py``) over a sequence of hand-built snapshots,
as the engine runs it (``evaluate_helpers.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from trainwarden.alerts import Alert, Rule, advance
from trainwarden.alerts.evaluate import evaluate
from trainwarden.alerts.snapshot import Snapshot

from .evaluate_helpers import PACK, RUN, _straggling, bend, run, with_ranks

# -- a healthy run is quiet ----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PACK))
def test_a_healthy_run_fires_no_default_rule(name: str) -> None:
    snap = run()
    # The rollups hold enough history for every baseline (warm-up + baseline + window).
    assert len(snap.stats["mfu"]) == 401
    assert evaluate(PACK[name], snap) == []


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
