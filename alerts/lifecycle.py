"""The life of one alert, as Prometheus has it: inactive → pending → firing → resolved.

Pure logic, no storage: the engine (next) feeds each evaluation's verdict for every
(rule, labels) and stores what comes back. An alert is identified by its fingerprint
(rule name + labels), so the same problem on the same rank is one alert however often
it is seen; a condition that returns after the alert resolved starts a new episode.

- ``for``: the condition must hold this long (a duration, or a number of the run's
  steps) before the alert fires; until then it is *pending*, and it goes back to
  inactive, unseen by anyone paged, if the condition clears.
- ``keep_firing_for``: a firing alert stays firing this long after the condition
  clears (flapping conditions page once); then it is *resolved*.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Literal

from .intervals import Interval

State = Literal["inactive", "pending", "firing", "resolved"]


def fingerprint(rule: str, labels: dict[str, str]) -> str:
    """Stable id of an alert: the rule and its labels (sorted), hashed."""
    key = json.dumps([rule, sorted(labels.items())], separators=(",", ":"))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Alert:
    rule: str
    labels: dict[str, str]
    state: State = "inactive"
    active_since: float | None = None  # when the condition last became true (time)
    active_since_step: int | None = None  # ... and at which step
    onset_step: int | None = None  # where the anomaly began in the data (Verdict.onset_step)
    fired_at: float | None = None
    fired_at_step: int | None = None  # the step it fired at (the verdict's, else the run's)
    cleared_at: float | None = None  # when the condition last became false while firing
    cleared_at_step: int | None = None
    resolved_at: float | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.rule, self.labels)


def _held(alert: Alert, span: Interval, now: float, step: int | None) -> bool:
    """Whether the condition has held for ``span`` (time or steps) by now. In steps, from
    where the data says its streak began (``onset_step``) when that is earlier than the
    pass that first saw it: with fast steps a pass sees a streak dozens of steps late,
    and a loss spike that has held 20 steps by then must not wait for another pass, which
    may come after it ended (issue 38's fast-step drill missed LossSpike so)."""
    if span.value == 0:
        return True
    if span.unit == "steps":
        began = [s for s in (alert.active_since_step, alert.onset_step) if s is not None]
        return step is not None and bool(began) and step - min(began) >= span.value
    return alert.active_since is not None and now - alert.active_since >= span.value


def advance(
    alert: Alert,
    *,
    active: bool,
    now: float,
    step: int | None = None,
    for_: Interval,
    keep_firing_for: Interval,
    verdict_step: int | None = None,
    onset_step: int | None = None,
) -> Alert:
    """The alert after one evaluation at ``now`` (and the run's ``step``) that found its
    condition ``active`` or not. Returns the same object when nothing changed.
    ``verdict_step``: the step the condition was found at (an XID's own step, say),
    kept as the step it fired at; else the run's step. ``onset_step``: where the
    verdict says the anomaly began; an episode keeps the earliest it was given (a later
    pass may no longer hold the start of the streak in its window)."""
    if active:
        if alert.state in ("inactive", "resolved"):  # a new episode
            alert = replace(
                alert,
                state="pending",
                active_since=now,
                active_since_step=step,
                onset_step=onset_step,
                fired_at=None,
                fired_at_step=None,
                cleared_at=None,
                cleared_at_step=None,
                resolved_at=None,
            )
        elif onset_step is not None and (alert.onset_step is None or onset_step < alert.onset_step):
            alert = replace(alert, onset_step=onset_step)
        if alert.state == "firing" and alert.cleared_at is not None:
            return replace(alert, cleared_at=None, cleared_at_step=None)  # back in time
        if alert.state == "pending" and _held(alert, for_, now, step):
            at = verdict_step if verdict_step is not None else step
            return replace(alert, state="firing", fired_at=now, fired_at_step=at)
        return alert
    if alert.state == "pending":
        return replace(
            alert, state="inactive", active_since=None, active_since_step=None, onset_step=None
        )
    if alert.state == "firing":
        if alert.cleared_at is None:
            alert = replace(alert, cleared_at=now, cleared_at_step=step)
        if _kept(alert, keep_firing_for, now, step):
            return alert
        return replace(alert, state="resolved", resolved_at=now)
    return alert


def _kept(alert: Alert, span: Interval, now: float, step: int | None) -> bool:
    """Whether a cleared firing alert is still within ``keep_firing_for``."""
    if span.value == 0:
        return False
    if span.unit == "steps":
        if step is None or alert.cleared_at_step is None:
            return True  # no step to count by yet
        return step - alert.cleared_at_step < span.value
    return alert.cleared_at is not None and now - alert.cleared_at < span.value
