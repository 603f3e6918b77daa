"""The alert lifecycle: pending while ``for`` runs, firing, kept firing, resolved, again."""

from __future__ import annotations

from trainwarden.alerts.intervals import ZERO, Interval
from trainwarden.alerts.lifecycle import Alert, advance, fingerprint

S30 = Interval(30, "s")
STEPS5 = Interval(5, "steps")


def run(
    alert: Alert, verdicts: list[tuple[bool, float, int | None]], **spans: Interval
) -> list[str]:
    states = []
    for active, now, step in verdicts:
        alert = advance(
            alert,
            active=active,
            now=now,
            step=step,
            for_=spans.get("for_", ZERO),
            keep_firing_for=spans.get("keep", ZERO),
        )
        states.append(alert.state)
    return states


def test_for_holds_an_alert_pending_until_the_condition_lasts() -> None:
    a = Alert("StepTimeRegression", {"run": "r"})
    assert run(
        a, [(True, 0, None), (True, 20, None), (True, 30, None), (True, 40, None)], for_=S30
    ) == [
        "pending",
        "pending",
        "firing",
        "firing",
    ]


def test_a_blip_shorter_than_for_never_fires() -> None:
    a = Alert("Straggler", {"rank": "3"})
    assert run(
        a, [(True, 0, None), (False, 10, None), (True, 20, None), (True, 45, None)], for_=S30
    ) == [
        "pending",
        "inactive",
        "pending",
        "pending",
    ]  # 45 - 20 < 30: the clock restarted


def test_for_in_steps_counts_the_runs_steps() -> None:
    a = Alert("LossSpike", {"run": "r"})
    verdicts = [(True, t, 100 + t) for t in range(7)]
    assert run(a, verdicts, for_=STEPS5) == ["pending"] * 5 + ["firing", "firing"]


def test_an_alert_keeps_the_steps_it_went_pending_and_fired_at() -> None:
    a = Alert("LossSpike", {"run": "r"})
    for t in range(9):
        a = advance(a, active=True, now=t, step=100 + t, for_=STEPS5, keep_firing_for=ZERO)
    assert (a.state, a.active_since_step, a.fired_at_step) == ("firing", 100, 105)
    a = advance(a, active=False, now=10, step=110, for_=STEPS5, keep_firing_for=ZERO)
    a = advance(a, active=True, now=11, step=111, for_=STEPS5, keep_firing_for=ZERO)
    assert (a.state, a.active_since_step, a.fired_at_step) == ("pending", 111, None)
    # An event's own step (an XID at step 50, heard of at step 59) is the step it fired at.
    xid = advance(
        Alert("FatalXid", {"rank": "1"}),
        active=True,
        now=0,
        step=59,
        for_=ZERO,
        keep_firing_for=ZERO,
        verdict_step=50,
    )
    assert (xid.state, xid.fired_at_step) == ("firing", 50)


def test_an_episode_keeps_the_earliest_onset_it_was_given() -> None:
    a = Alert("LossSpike", {"run": "r"})
    a = advance(a, active=True, now=0, step=140, for_=STEPS5, keep_firing_for=ZERO, onset_step=138)
    assert (a.state, a.active_since_step, a.onset_step) == ("pending", 140, 138)
    # A later pass whose window no longer holds the start of the streak says 139: kept 138.
    a = advance(a, active=True, now=1, step=141, for_=STEPS5, keep_firing_for=ZERO, onset_step=139)
    assert (a.state, a.onset_step) == ("pending", 138)
    a = advance(a, active=True, now=1, step=160, for_=STEPS5, keep_firing_for=ZERO, onset_step=130)
    assert (a.state, a.onset_step) == ("firing", 130)
    a = advance(a, active=True, now=2, step=170, for_=STEPS5, keep_firing_for=ZERO, onset_step=119)
    assert a.onset_step == 119  # more of the data arrived: earlier
    a = advance(a, active=False, now=3, step=180, for_=STEPS5, keep_firing_for=ZERO)
    a = advance(a, active=True, now=4, step=300, for_=STEPS5, keep_firing_for=ZERO, onset_step=298)
    assert (a.state, a.onset_step) == ("pending", 298)  # a new episode, a new onset
    gone = advance(a, active=False, now=5, step=301, for_=STEPS5, keep_firing_for=ZERO)
    assert (gone.state, gone.onset_step) == ("inactive", None)


def test_a_streak_that_held_for_its_steps_by_the_first_pass_fires_at_once() -> None:
    """``for`` in steps counts from where the data says the streak began: fast steps put a
    pass dozens of steps after the onset, and the spike may be over by the next pass."""
    a = Alert("LossSpike", {"run": "r"})
    late = advance(
        a, active=True, now=0, step=140, for_=STEPS5, keep_firing_for=ZERO, onset_step=121
    )
    assert (late.state, late.fired_at_step, late.onset_step) == ("firing", 140, 121)
    # No onset (a rule that gives none): from the pass that first saw it, as before.
    seen = advance(a, active=True, now=0, step=140, for_=STEPS5, keep_firing_for=ZERO)
    assert seen.state == "pending"
    assert advance(seen, active=True, now=1, step=144, for_=STEPS5, keep_firing_for=ZERO).state == (
        "pending"
    )
    assert advance(seen, active=True, now=1, step=145, for_=STEPS5, keep_firing_for=ZERO).state == (
        "firing"
    )


def test_without_for_an_alert_fires_at_once_and_resolves_when_clear() -> None:
    a = Alert("FatalXid", {"rank": "1", "code": "79"})
    states = run(a, [(True, 0, None), (False, 5, None), (False, 6, None)])
    assert states == ["firing", "resolved", "resolved"]


def test_keep_firing_for_rides_out_a_flapping_condition() -> None:
    a = Alert("HighExposedComm", {"run": "r"})
    verdicts = [
        (True, 0, None),
        (False, 10, None),
        (True, 20, None),
        (False, 30, None),
        (False, 59, None),
        (False, 60, None),
    ]
    assert run(a, verdicts, keep=S30) == [
        "firing",
        "firing",
        "firing",
        "firing",
        "firing",
        "resolved",
    ]


def test_keep_firing_for_in_steps() -> None:
    a = Alert("GradNormSpikeBurst", {"run": "r"})
    verdicts = [(True, 0, 10), (False, 1, 11), (False, 2, 15), (False, 3, 16)]
    assert run(a, verdicts, keep=STEPS5) == ["firing", "firing", "firing", "resolved"]


def test_a_condition_that_returns_after_resolving_is_a_new_episode() -> None:
    a = advance(
        Alert("RankHung", {"rank": "2"}), active=True, now=0, for_=ZERO, keep_firing_for=ZERO
    )
    a = advance(a, active=False, now=10, for_=ZERO, keep_firing_for=ZERO)
    assert a.state == "resolved" and a.resolved_at == 10
    again = advance(a, active=True, now=50, for_=S30, keep_firing_for=ZERO)
    assert again.state == "pending" and again.active_since == 50
    assert again.fired_at is None and again.resolved_at is None
    assert again.fingerprint == a.fingerprint


def test_nothing_changed_returns_the_same_object() -> None:
    a = Alert("LowMFU", {"run": "r"})
    assert advance(a, active=False, now=0, for_=S30, keep_firing_for=ZERO) is a
    firing = advance(a, active=True, now=0, for_=ZERO, keep_firing_for=ZERO)
    assert firing.state == "firing"
    assert advance(firing, active=True, now=99, for_=ZERO, keep_firing_for=ZERO) is firing


def test_the_fingerprint_is_rule_and_labels_in_any_order() -> None:
    one = fingerprint("Straggler", {"run": "r", "rank": "3"})
    assert one == fingerprint("Straggler", {"rank": "3", "run": "r"})
    assert one != fingerprint("Straggler", {"run": "r", "rank": "4"})
    assert one != fingerprint("RankHung", {"run": "r", "rank": "3"})
    assert len(one) == 16
