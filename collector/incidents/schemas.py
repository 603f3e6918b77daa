"""Incidents and logbook notes as the API and the UI show them, and what an operator
sends to open, close, merge or retitle an incident or to add a note."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainwarden.collector.ingest.schema_checks import INT64_MAX, MAX_STEP


class IncidentOut(BaseModel):
    id: int
    run: str
    title: str
    state: Literal["open", "closed", "merged"]
    severity: str
    auto: bool
    opened_at: float
    opened_by: str
    closed_at: float | None
    closed_by: str | None
    summary: str | None
    merged_into: int | None
    ranks: list[int]
    nodes: list[str]
    history: list[dict[str, Any]]
    alerts: list[int]
    actions: list[int]
    posted_at: float | None
    post_status: str | None
    updated_at: float


class OpenIn(BaseModel):
    """An operator opens an incident on a run."""

    model_config = ConfigDict(extra="forbid")
    run: str = Field(min_length=1, max_length=128)
    title: str = Field(min_length=1, max_length=200)
    by: str = Field(min_length=1, max_length=128)
    alerts: list[int] = Field(
        default_factory=list,
        max_length=1000,
        description="alerts of the run that belong to it (in no incident yet)",
    )
    at: float | None = Field(
        default=None,
        description="when it began (epoch s); default: its first alert went pending, else now",
    )


class CloseIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128)
    summary: str | None = Field(
        default=None, max_length=2000, description="what happened, in a line"
    )


class MergeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128)
    incidents: list[Annotated[int, Field(ge=1, le=INT64_MAX)]] = Field(
        min_length=1, max_length=100, description="merged into this one"
    )


class RetitleIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: str = Field(min_length=1, max_length=128)
    title: str = Field(min_length=1, max_length=200)


class NoteIn(BaseModel):
    """A note of the operator logbook."""

    model_config = ConfigDict(extra="forbid")
    author: str = Field(min_length=1, max_length=128)
    text: str = Field(min_length=1, max_length=10_000)
    at: float | None = Field(
        default=None, ge=0, le=4e9, description="what it is about (epoch s); default now"
    )
    step: int | None = Field(default=None, ge=0, le=MAX_STEP)
    incident: int | None = Field(
        default=None, ge=1, le=INT64_MAX, description="default: the run's open incident"
    )


class NoteOut(BaseModel):
    id: int
    run: str
    incident: int | None
    author: str
    text: str
    at: float
    step: int | None
    created_at: float
