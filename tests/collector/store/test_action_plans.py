"""The typed action plans (``collector/store/action_plans.py``): what was stored reads
back and is written back the same, unknown keys included; only keys set are written."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainwarden.collector.store.action_plans import EvictPlan, RollbackPlan, StopPlan

STORED = {
    "attempt": 2,
    "restores": [{"checkpoint_step": 100, "steps": [101, 105], "detail": "still 9x"}],
    "below_step": 100,
    "round_start": 2,
    "issued_at_step": 121,
    "onset_step": 115,
    "keep_data": False,
    "rollback": {
        "checkpoint_step": 90,
        "checkpoint_path": "/ckpt/90",
        "skip_from": 91,
        "skip_to": 130,
        "lr_scale": None,
        "reason": "rule:LossSpike: onset at step 115",
    },
    "ranks": [0, 1],
    "prepared_at": 1.5,
    "from_a_newer_collector": {"kept": True},
}


def test_a_stored_plan_reads_back_and_is_written_back_the_same() -> None:
    plan = RollbackPlan.of(STORED)
    assert plan.dump() == STORED
    assert plan.rollback is not None and plan.rollback.skip_to == 130
    assert plan.restores is not None and plan.restores[0].steps == [101, 105]
    assert plan.has("prepared_at") and not plan.has("committed_at")
    plan.committed_at = 2.5  # a step taken: written from now on
    assert plan.dump() == {**STORED, "committed_at": 2.5}
    assert RollbackPlan.of(None).dump() == {} and StopPlan.of({}).dump() == {}


def test_the_next_attempt_keeps_what_it_carries() -> None:
    assert RollbackPlan.of(STORED).carried().dump() == {
        k: STORED[k] for k in ("attempt", "restores", "below_step", "round_start")
    }


def test_a_plan_of_the_wrong_shape_is_refused_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="ranks"):
        StopPlan.of({"ranks": "all"})
    with pytest.raises(ValidationError, match="evicted_at"):
        EvictPlan.of({"evicted_at": "yesterday"})
