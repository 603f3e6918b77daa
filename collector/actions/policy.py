"""The action policy (``serve --actions FILE``): per kind, its mode (auto, require-ack,
dry-run) and limits: the rollback's margins, budget, timeouts and result check; the
eviction's backend, blast radius and cool-down. Checked when loaded, with the file,
line, field and problem on each line (read as every config file is:
``alerts/config_file.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from trainwarden.alerts.config_file import ConfigFileError, StrictModel, read_yaml, validate
from trainwarden.alerts.intervals import Duration, Interval
from trainwarden.collector.actions.evict import load_backend
from trainwarden.collector.actions.rollback_check import MIN_STEPS

Mode = Literal["auto", "require-ack", "dry-run"]


Kind = Literal["rollback", "evict", "stop"]


class Budget(StrictModel):
    count: int = Field(default=3, ge=1)
    per: Duration = Interval(6 * 3600.0, "s")


class RollbackPolicy(StrictModel):
    mode: Mode = "dry-run"
    margin_steps: int = Field(
        default=3,
        ge=0,
        description="steps before the newest clean checkpoint step (onset - 2) that the "
        "checkpoint must also precede: with the default, at least 5 steps before the onset",
    )
    skip_margin_steps: int = Field(
        default=10, ge=0, description="skip this far past the newest step"
    )
    lr_scale: float | None = Field(default=None, gt=0, le=1)
    budget: Budget = Budget()
    prepare_timeout: Duration = Interval(15.0, "s")
    """How long every rank has to answer the prepare (the others hold meanwhile)."""
    apply_timeout: Duration = Interval(120.0, "s")
    attempts: int = Field(default=3, ge=1, description="prepares tried before giving up")
    verify_steps: int = Field(
        default=MIN_STEPS,
        ge=0,
        description="steps run again after the restore on which the alert's rule must no "
        "longer hold before the rollback is done (at least the rule's window; 0: no check)",
    )
    verify_timeout: Duration = Interval(300.0, "s")
    """How long to wait for those steps; then the rollback is done, unchecked, and says so."""


class EvictPolicy(StrictModel):
    mode: Mode = "dry-run"
    backend: dict[str, Any] | None = None
    """``collector/actions/evict/``'s ``load_backend`` spec, e.g. ``{backend: slurm}``."""
    max_nodes_fraction_per_hour: float = Field(default=0.25, gt=0, le=1)
    cooldown: Duration = Interval(600.0, "s")
    timeout: Duration = Interval(30.0, "s")

    @field_validator("backend")
    @classmethod
    def _known(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            load_backend(value)  # raises ValueError naming the field
        return value


class StopPolicy(StrictModel):
    mode: Mode = "dry-run"
    prepare_timeout: Duration = Interval(15.0, "s")
    """How long every rank has to answer a stop of the whole run (the others hold
    meanwhile) before each is stopped at its next step instead."""


class ActionPolicy(StrictModel):
    rollback: RollbackPolicy = RollbackPolicy()
    evict: EvictPolicy = EvictPolicy()
    stop: StopPolicy = StopPolicy()

    def of(self, kind: str) -> Any:
        return getattr(self, kind)


class ActionConfigError(ConfigFileError):
    """An actions file that cannot be used: file, line, field and problem on each line."""


def load_policy(path: Path | str | None) -> ActionPolicy:
    """The policy in the YAML file ``path`` (every action a dry run without one)."""
    if path is None:
        return ActionPolicy()
    path = Path(path)
    doc = read_yaml(path, what="action policy", error=ActionConfigError)
    policy: ActionPolicy = validate(ActionPolicy, path, doc, ActionConfigError)
    return policy
