"""Each rule kind over a snapshot of one run's recent records: which alerts are active now.

The engine (``collector/alerting/engine.py``) fetches a :class:`Snapshot` per run and pass
from the database, with the windows the loaded rules need; tests build snapshots by
hand. ``evaluate(rule, snapshot)`` returns a :class:`Verdict` for every run (rank-less)
or rank on which the rule's condition holds now; everything not returned is inactive.
The lifecycle (``for``, ``keep_firing_for``) is applied afterwards, by ``lifecycle.advance``.

The kinds: ``evaluate_metrics.py`` (threshold, baseline, peer) and ``evaluate_events.py``
(event, rate, absence, cadence); the snapshot and verdict types: ``snapshot.py``.

Instants (an XID, a spike flag, a NaN, an event) hold for ``hold_s`` after the record
*arrived*, long enough for the next pass to see them whatever the ingest lag; the
alert then resolves after the rule's ``keep_firing_for``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .evaluate_events import absence, cadence, event, rate
from .evaluate_metrics import baseline, peer, threshold
from .rules import (
    AbsenceRule,
    BaselineRule,
    CadenceRule,
    EventRule,
    PeerRule,
    RateRule,
    Rule,
    ThresholdRule,
)
from .snapshot import Snapshot, Verdict

_KINDS: dict[type, Callable[[Any, Snapshot], list[Verdict]]] = {
    ThresholdRule: threshold,
    BaselineRule: baseline,
    PeerRule: peer,
    EventRule: event,
    AbsenceRule: absence,
    RateRule: rate,
    CadenceRule: cadence,
}


def evaluate(rule: Rule, snap: Snapshot) -> list[Verdict]:
    """The runs / ranks on which ``rule``'s condition holds in ``snap``."""
    return _KINDS[type(rule)](rule, snap)
