"""The API's models of hung collectives (``/api/v1/runs/{run}/collectives``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class CollectivesOut(BaseModel):
    """The ranks' newest Flight Recorder rings and the verdict on them."""

    run: str
    requested_at: float | None = Field(description="When the ranks were last asked")
    stored_at: float | None = Field(
        description="When a verdict was last stored (a hang_verdict event)"
    )
    verdict: dict[str, Any] | None = Field(
        description="kind (culprit, desync, none, incomplete, no_data, crashed), summary, "
        "culprits, victims, dead, no_ring, unusable (rank -> why its ring was left out), "
        "unread (incomplete: members whose ring is not in or was left out), group, seq, "
        "op, desync (pg, seq, sides), crashes (as below, when a rank died of a signal: "
        "``crashed`` when no ring names a culprit); None when no rank sent a ring and none "
        "crashed"
    )
    groups: list[dict[str, Any]] = Field(
        description="Per process group: pg, desc, ranks, and rows (rank, node, last_seq, op, "
        "in_sizes, in_dtypes, state, done, since, role, dumped_at, note), culprits first"
    )
    rings: dict[str, dict[str, Any]] = Field(
        description="Per rank: when its ring came (at), what asked (trigger), available, reason"
    )
    crashes: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per rank that died of a signal (its current session; its last words, "
        "sent by a survivor of its node): rank, at, signal, collective, where, step, in_step, "
        "cause (the C++ message, when its stderr was its own file), cause_note (else why "
        "not), stack (innermost frames), summary",
    )


class CollectivesAsked(BaseModel):
    run: str
    requested_at: float
    ranks: int = Field(description="How many ranks were asked")
