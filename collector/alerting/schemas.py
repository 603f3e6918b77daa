"""Alerts, silences and their deliveries as the API and the UI show them, and what an
operator sends to acknowledge or silence."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

State = Literal["pending", "firing", "resolved"]


class Delivery(BaseModel):
    receiver: str
    kind: str
    status: str
    attempt: int
    ok: bool
    http_status: int | None
    error: str | None
    at: float
    duration_s: float
    final: bool


class AlertOut(BaseModel):
    id: int
    fingerprint: str
    rule: str
    run: str
    rank: int | None
    node: str | None
    gpu: str | None
    severity: str
    state: State
    labels: dict[str, str]
    annotations: dict[str, str]
    runbook_url: str | None
    value: float | None
    step: int | None
    action: str
    active_since: float
    fired_at: float | None
    # The step it fired at (``step``: the newest step its condition held at).
    fired_at_step: int | None = None
    # Where the anomaly began in the data (the first step of the rule's streak, or the
    # event's own step): what a rollback chooses its checkpoint by.
    onset_step: int | None = None
    resolved_at: float | None
    updated_at: float
    acked_at: float | None
    acked_by: str | None
    ack_comment: str | None
    silenced_by: int | None
    inhibited_by: int | None
    notified: str | None
    last_sent_at: float | None
    deliveries: list[Delivery] | None = None


class AckIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128, description="Who acknowledges")
    comment: str = Field(default="", max_length=1000)


class Matcher(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=64)
    value: str = Field(max_length=256)
    regex: bool = False

    @model_validator(mode="after")
    def _compiles(self) -> Matcher:
        if self.regex:
            try:
                re.compile(self.value)
            except re.error as exc:
                raise ValueError(
                    f"value {self.value!r} is not a regular expression: {exc}"
                ) from None
        return self


class SilenceIn(BaseModel):
    """Silence the alerts whose labels match every matcher (labels: alertname, severity,
    run, rank, node, gpu and the rule's own, e.g. category)."""

    model_config = ConfigDict(extra="forbid")
    matchers: list[Matcher] = Field(min_length=1, max_length=32)
    starts_at: float | None = Field(default=None, description="Epoch seconds; default now")
    ends_at: float | None = Field(default=None, description="Epoch seconds; or give duration_s")
    duration_s: float | None = Field(default=None, gt=0, le=90 * 86400)
    created_by: str = Field(min_length=1, max_length=128)
    comment: str = Field(
        min_length=1, max_length=1000, description="Why: read by whoever is paged next"
    )

    @field_validator("matchers")
    @classmethod
    def _not_everything(cls, value: list[Matcher]) -> list[Matcher]:
        if all(mt.regex and mt.value in (".*", ".+") for mt in value):
            raise ValueError("these matchers silence every alert; name the rule, run or rank")
        return value

    @model_validator(mode="after")
    def _one_end(self) -> SilenceIn:
        if (self.ends_at is None) == (self.duration_s is None):
            raise ValueError("give exactly one of ends_at and duration_s")
        return self


class SilenceOut(BaseModel):
    id: int
    matchers: list[Matcher]
    starts_at: float
    ends_at: float
    created_by: str
    comment: str
    created_at: float
    active: bool
