"""Actions and checkpoints as the API and the UI show them, and what an operator sends
to ask for an action or to approve or cancel one."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

State = Literal["proposed", "approved", "executing", "done", "failed", "cancelled"]


class ActionOut(BaseModel):
    id: int
    run: str
    kind: str
    state: State
    mode: str
    trigger: str
    alert_id: int | None
    rank: int | None
    node: str | None
    approver: str | None
    plan: dict[str, Any] | None
    result: dict[str, Any] | None
    reason: str | None
    history: list[dict[str, Any]]
    created_at: float
    updated_at: float
    finished_at: float | None
    commands: list[dict[str, Any]] | None = None


class ActionIn(BaseModel):
    """An operator's action on a run."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["rollback", "evict", "stop"]
    by: str = Field(min_length=1, max_length=128, description="Who asks (kept in the audit trail)")
    reason: str = Field(min_length=1, max_length=1000)
    checkpoint_step: int | None = Field(default=None, ge=0, description="rollback: this checkpoint")
    node: str | None = Field(
        default=None, min_length=1, max_length=255, description="evict: this node"
    )
    rank: int | None = Field(default=None, ge=0, description="stop: only this rank")
    dry_run: bool = False

    @model_validator(mode="after")
    def _fits(self) -> ActionIn:
        if self.kind == "evict" and self.node is None:
            raise ValueError("an eviction names its node")
        if self.kind != "evict" and self.node is not None:
            raise ValueError(f"node is for evictions, not a {self.kind}")
        if self.kind != "rollback" and self.checkpoint_step is not None:
            raise ValueError(f"checkpoint_step is for rollbacks, not a {self.kind}")
        return self


class ByIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128)
    reason: str = Field(default="", max_length=1000)


class CheckpointOut(BaseModel):
    step: int
    path: str | None
    ts: float
    rank: int | None
    meta: dict[str, Any]
    good: bool
    suspect: str | None = Field(description="why it is not good: saved before an anomaly cleared")
