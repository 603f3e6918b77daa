"""What an action's ``plan`` column holds, typed: a rollback's, an eviction's, a stop's.

The column is JSON, written and read by the action engine (``collector/actions``) and
read by the run's goodput (``read/economics.py``), its node changes (``read/identity.py``)
and its data checks (``health/samples.py``). Each plan is a model here, one field per key;
a key that was never set is not written (``dump``), so the JSON holds what the action
did so far (``committed_at`` present: the commit went out) and reads back the same.
Unknown keys (a newer collector's) are kept as they are.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

P = TypeVar("P", bound="Plan")


class Plan(BaseModel):
    model_config = ConfigDict(extra="allow")

    @classmethod
    def of(cls: type[P], stored: Any) -> P:
        """The plan as stored (a dict, or None: nothing planned yet)."""
        return cls.model_validate(stored or {})

    def dump(self) -> dict[str, Any]:
        """The JSON to store: the keys set so far."""
        return self.model_dump(mode="json", exclude_unset=True)

    def has(self, key: str) -> bool:
        """Whether ``key`` was set (the step it marks was taken)."""
        return key in self.model_fields_set


class RollbackSpec(Plan):
    """What every rank is told to do (``tw.RollbackPlan``): restore this checkpoint, skip
    this data window (empty when ``skip_to`` < ``skip_from``), scale the learning rate."""

    checkpoint_step: int
    checkpoint_path: str = ""
    skip_from: int
    skip_to: int
    lr_scale: float | None = None
    reason: str = ""


class Restore(Plan):
    """A restore whose check found the anomaly still there."""

    checkpoint_step: int
    steps: list[int] = []
    detail: str


class RollbackPlan(Plan):
    # Kept across the action's attempts (:meth:`carried`).
    attempt: int | None = None
    checkpoint_step: int | None = None
    """An operator's checkpoint (``POST /api/v1/runs/{run}/actions``)."""
    below_step: int | None = None
    """Restore only older than this (a restore of it did not fix the anomaly)."""
    restores: list[Restore] | None = None
    round_start: int | None = None
    """The attempt at which the current restore began (its prepare retries count from it)."""
    after_evict: int | None = None
    """The eviction (``evict+rollback``) this rollback waits for."""
    # Planned (``actions/rollback.py``).
    issued_at_step: int | None = None
    onset_step: int | None = None
    keep_data: bool | None = None
    rollback: RollbackSpec | None = None
    # Carried out (``actions/rollback_transitions.py``).
    ranks: list[int] | None = None
    prepared_at: float | None = None
    committed_at: float | None = None
    barrier_step: int | None = None
    answered_at_step: int | None = None
    restored_at: float | None = None
    restored_ts: float | None = None
    """When the first rank restored, on the ranks' clock."""
    rule: str | None = None
    """The rule whose check the restore waits for."""
    result: dict[str, Any] | None = None

    CARRIED: ClassVar[tuple[str, ...]] = (
        "attempt",
        "checkpoint_step",
        "below_step",
        "restores",
        "round_start",
        "after_evict",
    )

    def carried(self) -> RollbackPlan:
        """What the action's next attempt keeps: the attempt count, an operator's
        checkpoint, the restores that did not fix the anomaly, the eviction it follows."""
        return RollbackPlan.model_validate(
            {k: v for k, v in self.dump().items() if k in self.CARRIED}
        )


class StopPlan(Plan):
    ranks: list[int] | None = None
    sent_at: float | None = None
    prepared_at: float | None = None
    """A stop of every rank at one barrier: when its prepare went out."""
    barrier_step: int | None = None
    plain_at: float | None = None
    """When it fell back to a plain stop (a rank did not answer the prepare)."""


class EvictPlan(Plan):
    node: str | None = None
    ranks: list[int] | None = None
    backend: str | None = None
    started_at: float | None = None
    evicted_at: float | None = None
    steps: list[str] | None = None
    output: str | None = None
