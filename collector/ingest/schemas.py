"""Request and response bodies of the HTTP API (pydantic), validated at the edge: one
agent's batch (``IngestBatch``: its header ``AgentInfo``, its steps, events and GPU
samples) and the answer (``IngestResult``). The records' own models are in
``schema_steps``, ``schema_events`` and ``schema_gpu``, a node's column-wise batch in
``schema_columns``, the bounds and checks they share in ``schema_checks``.

Unknown fields are ignored rather than refused so that a newer agent can talk to an
older collector; every known field is checked, and a wrong one is a 422 naming it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator

from trainwarden.collector.ingest.schema_checks import (
    MAX_RECORDS_PER_BATCH,
    RUN_NAME_PATTERN,
    not_in_the_future,
)
from trainwarden.collector.ingest.schema_events import EventIn
from trainwarden.collector.ingest.schema_gpu import GpuSampleIn
from trainwarden.collector.ingest.schema_steps import StepIn


class AgentInfo(BaseModel):
    """Who sent the batch: one process of one rank."""

    rank: int = Field(ge=0)
    world_size: int = Field(ge=1, le=1_000_000)
    local_rank: int = Field(default=0, ge=0, le=1_000_000)
    host: str = Field(min_length=1, max_length=255)
    node: str | None = Field(default=None, max_length=255)
    pid: int | None = Field(default=None, ge=0, le=2**31 - 1)
    session: str = Field(min_length=1, max_length=64, description="Unique per process lifetime")
    started_at: float | None = None
    version: str | None = Field(default=None, max_length=32)
    sent_at: float | None = None
    heartbeat_s: float | None = Field(default=None, gt=0, le=3600)
    last_step: int | None = Field(default=None, ge=0, le=2**62)
    last_step_end: float | None = Field(default=None, description="Wall time the last step ended")
    in_step: bool | None = None
    phase: str | None = Field(default=None, max_length=32)

    @field_validator("started_at", "sent_at", "last_step_end")
    @classmethod
    def _plausible(cls, ts: float | None) -> float | None:
        return None if ts is None else not_in_the_future(ts)

    @model_validator(mode="after")
    def _rank_in_world(self) -> AgentInfo:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        return self


AGENT_FIELDS = tuple(AgentInfo.model_fields)


class IngestBatch(BaseModel):
    """``POST /api/v1/ingest``: one agent's batch of step records and events."""

    run: str = Field(pattern=RUN_NAME_PATTERN)
    agent: AgentInfo
    steps: list[StepIn] = Field(default_factory=list, max_length=MAX_RECORDS_PER_BATCH)
    events: list[EventIn] = Field(default_factory=list, max_length=MAX_RECORDS_PER_BATCH)
    gpu: list[GpuSampleIn] = Field(default_factory=list, max_length=MAX_RECORDS_PER_BATCH)

    @model_validator(mode="after")
    def _ranks_in_world(self) -> IngestBatch:
        for e in self.events:
            if e.rank is not None and e.rank >= self.agent.world_size:
                raise ValueError(
                    f"a {e.kind} event's rank {e.rank} is outside world_size "
                    f"{self.agent.world_size}"
                )
        return self


class IngestResult(BaseModel):
    accepted_steps: int
    accepted_events: int
    commands: list[dict[str, Any]] = Field(
        default_factory=list, description="Commands for this agent (rollback, stop, ...)"
    )
    rank_commands: dict[int, list[dict[str, Any]]] | None = Field(
        default=None,
        description="A columnar batch's answer: the commands waiting for each of its ranks "
        "(only ranks that have some), which a relay hands to each rank's agent",
    )
    rank_refused: dict[int, dict[str, Any]] | None = Field(
        default=None,
        description="A columnar batch's ranks whose rows were refused (the others' were "
        "stored), each with the answer a relay gives that rank's agent: its status (409: "
        "another live process holds the rank; 503: send again later), detail and holder",
    )
    # A rank's batch refused whole (nothing stored): the route answers it with its status
    # (409: another live process holds the rank; 503: send again later) and this body.
    _refused: dict[str, Any] | None = PrivateAttr(default=None)

    @property
    def refusal(self) -> dict[str, Any] | None:
        """Why this rank's batch was refused (``status`` and the answer's body), or None."""
        return self._refused

    def refuse(self, answer: dict[str, Any]) -> None:
        self._refused = answer
