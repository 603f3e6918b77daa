"""The events of the ingest wire format (``EventIn``), and the data of the event kinds
that have a form of their own: collectives, epoch_end, attempt_start, rank_crashed."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from trainwarden.collector.ingest.schema_checks import (
    INT64_MAX,
    MAX_RANK,
    MAX_STEP,
    check_mixture,
    not_in_the_future,
)


class CollectiveEntryIn(BaseModel):
    """One collective of a rank's Flight Recorder ring (``agent/flight.py``)."""

    seq: int = Field(ge=0, le=INT64_MAX, description="Its sequence id in its process group")
    op: str = Field(min_length=1, max_length=64)
    in_sizes: list[list[int]] = Field(default_factory=list, max_length=256)
    in_dtypes: list[str] = Field(default_factory=list, max_length=256)
    out_sizes: list[list[int]] = Field(default_factory=list, max_length=256)
    out_dtypes: list[str] = Field(default_factory=list, max_length=256)
    state: str = Field(default="", max_length=32)
    done: bool = False
    created: float | None = None
    started: float | None = None
    completed: float | None = None

    @field_validator("created", "started", "completed")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


class CollectiveGroupIn(BaseModel):
    """A process group's newest collectives on one rank, oldest first."""

    pg: str = Field(min_length=1, max_length=64, description="The group's name (pg 0: default)")
    desc: str = Field(default="", max_length=256)
    ranks: list[Annotated[int, Field(ge=0, le=MAX_RANK)]] = Field(
        default_factory=list, max_length=MAX_RANK
    )
    entries: list[CollectiveEntryIn] = Field(default_factory=list, max_length=2048)
    last_enqueued: int | None = Field(default=None, ge=0, le=INT64_MAX)
    last_completed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    dropped: int = Field(default=0, ge=0)


class CollectivesIn(BaseModel):
    """A ``collectives`` event's data: the rank's Flight Recorder ring, or why none."""

    trigger: str = Field(default="command", max_length=32)
    request: int | None = None
    available: bool
    reason: str | None = Field(default=None, max_length=2000)
    dumped_at: float | None = None
    groups: list[CollectiveGroupIn] = Field(default_factory=list, max_length=256)


class EpochEndIn(BaseModel):
    """An ``epoch_end`` event's data (agent/datafeed.py): a rank ended an epoch."""

    epoch: int = Field(ge=0, le=2**31)
    last_step: int = Field(ge=0, le=MAX_STEP)
    dataset_size: int | None = Field(default=None, ge=1, le=2**31)
    kept: int | None = Field(default=None, ge=1, le=2**31)
    exact: bool | None = None
    dropped: int | None = Field(
        default=None, ge=0, le=2**31, description="Samples the loader leaves out by design"
    )

    @model_validator(mode="after")
    def _kept_within(self) -> EpochEndIn:
        if (self.kept is None) != (self.dataset_size is None):
            raise ValueError("dataset_size and kept come together")
        if (
            self.kept is not None
            and self.dataset_size is not None
            and self.kept > self.dataset_size
        ):
            raise ValueError(f"kept {self.kept} is over dataset_size {self.dataset_size}")
        return self


class AttemptStartIn(BaseModel):
    """What an ``attempt_start`` event's data must hold in a form of its own (the rest is
    the process's identity, kept as it comes): a declared ``data_mixture``."""

    model_config = ConfigDict(extra="allow")

    data_mixture: dict[str, Any] | None = None

    @field_validator("data_mixture")
    @classmethod
    def _mixture(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else check_mixture(value)


class CrashFrameIn(BaseModel):
    """One Python frame of a crashed rank's stack (faulthandler's)."""

    file: str = Field(max_length=300)
    line: int | None = Field(default=None, ge=0, le=2**31)
    function: str = Field(max_length=200)


class RankCrashedIn(BaseModel):
    """A ``rank_crashed`` event's data (``agent/last_words.py``): a rank's process died of
    a fatal signal; a surviving process of its node sends it on its behalf. The rest (the
    fault dump, its stderr's tail, who reported it) is kept as it comes."""

    model_config = ConfigDict(extra="allow")

    signal: str | None = Field(default=None, max_length=16)
    fatal: str | None = Field(default=None, max_length=200)
    session: str = Field(min_length=1, max_length=64)
    stack: list[CrashFrameIn] = Field(default_factory=list, max_length=100)
    collective: str | None = Field(default=None, max_length=200)
    where: str | None = Field(default=None, max_length=600)
    cause: str | None = Field(default=None, max_length=4000)
    cause_note: str | None = Field(default=None, max_length=2000)
    fault: str | None = Field(default=None, max_length=16_384)
    stderr_tail: str | None = Field(default=None, max_length=8192)
    last_step: int | None = Field(default=None, ge=0, le=MAX_STEP)
    in_step: bool = False


EVENT_DATA: dict[str, type[BaseModel]] = {
    "collectives": CollectivesIn,
    "rank_crashed": RankCrashedIn,
    "epoch_end": EpochEndIn,
    "attempt_start": AttemptStartIn,
}
"""Event kinds whose data has a form of its own, checked at the edge."""
ON_BEHALF = frozenset({"rank_crashed"})
"""Event kinds another process may send for a rank (``EventIn.rank``): a dead rank's last
words, sent by a survivor of its node."""


class EventIn(BaseModel):
    """Something that happened on a rank at a time (start, shutdown, restart, ...)."""

    id: str = Field(
        min_length=1, max_length=64, description="Unique id; a replayed event is ignored"
    )
    kind: str = Field(min_length=1, max_length=64)
    ts: float
    _ts_now = field_validator("ts")(not_in_the_future)
    step: int | None = Field(default=None, ge=0, le=2**62)
    severity: Literal["info", "warning", "critical"] = "info"
    data: dict[str, Any] = Field(default_factory=dict)
    rank: int | None = Field(
        default=None,
        ge=0,
        le=MAX_RANK,
        description="The rank it happened on, when not the sender's: a dead rank's "
        "rank_crashed, sent by a surviving process of its node",
    )

    @model_validator(mode="after")
    def _data_of_its_kind(self) -> EventIn:
        if self.rank is not None and self.kind not in ON_BEHALF:
            raise ValueError(
                f"a {self.kind} event names no other rank: only {sorted(ON_BEHALF)} may"
            )
        model = EVENT_DATA.get(self.kind)
        if model is not None:
            try:
                model.model_validate(self.data)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(part) for part in ("data", *first["loc"]))
                raise ValueError(
                    f"{'an' if self.kind[0] in 'aeiou' else 'a'} {self.kind} event's {where}: "
                    f"{first['msg']} "
                    f"(got {str(first.get('input'))[:80]!r})"
                ) from None
        return self
