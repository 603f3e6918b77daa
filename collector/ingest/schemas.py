"""Request and response bodies of the HTTP API (pydantic), validated at the edge.

Unknown fields are ignored rather than refused so that a newer agent can talk to an
older collector; every known field is checked, and a wrong one is a 422 naming it.
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from fastapi import Path as FastApiPath
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from trainwarden.collector.ingest import user_metrics

RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
MAX_RECORDS_PER_BATCH = 20_000
INT64_MAX = 2**63 - 1  # counters are stored as BIGINT
MAX_STEP = 2**62  # a step number the database and every query can hold
MAX_RANK = 1_000_000  # as world_size
RowId = Annotated[int, FastApiPath(ge=1, le=INT64_MAX, description="The row's id")]
"""An id in a URL path: past a BIGINT is not found, not an error of the database."""
MAX_FUTURE_S = 24 * 3600.0  # a timestamp further ahead than this is a broken clock


MIN_TS = 0.0  # epoch seconds: a negative one is no time at all
FINGERPRINT_PATTERN = r"^[0-9a-f]{32}$"
PROBE_WITHOUT_CHECK = "probe: sent without the step's fingerprint (a probed step is a checked step)"
SAMPLES_WITHOUT_DIGEST = "samples_kept / samples_epoch: sent without the step's samples_digest"
SOURCE_NAME = r"^[a-z][a-z0-9_.-]{0,31}$"  # as the agent's (agent/mixture.py)
MAX_SOURCES = 32
_source_name = re.compile(SOURCE_NAME).match


def check_int64(ids: list[int]) -> None:
    """Ids that fit int64, checked once a list (its least and greatest), not id by id."""
    if min(ids) < -INT64_MAX - 1 or max(ids) > INT64_MAX:
        raise ValueError("samples_kept: an id outside int64")


def check_sources(sources: dict[str, Any]) -> None:
    """A step's ``data_sources``: at most :data:`MAX_SOURCES` names of the agent's form."""
    if len(sources) > MAX_SOURCES:
        raise ValueError(f"data_sources: {len(sources)} sources, at most {MAX_SOURCES}")
    for name in sources:
        if not _source_name(name):
            raise ValueError(f"data_sources: source name {name[:40]!r} must match {SOURCE_NAME}")


def check_mixture(mixture: Any) -> dict[str, float]:
    """A declared data mixture (``tw.init(data_mixture=...)``): source names of the agent's
    form, weights >= 0 that sum to 1 (within 1e-6). Raises ``ValueError`` saying what."""
    if not isinstance(mixture, dict) or not mixture:
        raise ValueError("must be a mapping of source names to weights")
    check_sources(mixture)
    for name, weight in mixture.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{name!r}: a weight must be a number, got {weight!r:.40}")
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{name!r}: a weight must be >= 0, got {weight!r}")
    total = sum(mixture.values())
    if abs(total - 1) > 1e-6:
        raise ValueError(f"the weights must sum to 1, they sum to {total:.6g}")
    return {name: float(w) for name, w in mixture.items()}


REPLICA_GROUP_PATTERN = r"^[0-9]+(-[0-9]+(:[0-9]+)?)?(,[0-9]+(-[0-9]+(:[0-9]+)?)?)*$"


def _not_in_the_future(ts: float) -> float:
    """A plausible wall-clock time: after 1970, and not a day ahead of the collector's."""
    if not ts >= MIN_TS:  # also NaN
        raise ValueError(f"timestamp {ts} is before 1970: send epoch seconds")
    ahead = ts - time.time()
    if ahead > MAX_FUTURE_S:
        raise ValueError(
            f"timestamp is {ahead / 3600:.0f} h in the future: check this host's clock"
        )
    return ts


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
        return None if ts is None else _not_in_the_future(ts)

    @model_validator(mode="after")
    def _rank_in_world(self) -> AgentInfo:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        return self


class StepIn(BaseModel):
    """One rank's record of one step."""

    step: int = Field(ge=0, le=2**62)
    ts: float = Field(description="Wall-clock start of the step, epoch seconds")
    duration_s: float = Field(ge=0)
    data_wait_s: float | None = Field(default=None, ge=0)
    tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    loss: float | None = Field(
        default=None, description='NaN/Inf may be sent as "nan", "inf", "-inf"'
    )
    grad_norm: float | None = Field(
        default=None, description="Global gradient norm; NaN/Inf as for loss"
    )
    fwd_s: float | None = Field(default=None, ge=0, description="Forward phase")
    bwd_s: float | None = Field(
        default=None, ge=0, description="Backward phase (with the loss and the gradient-sync tail)"
    )
    opt_s: float | None = Field(default=None, ge=0, description="Optimizer phase")
    other_s: float | None = Field(default=None, ge=0, description="The rest of the step")
    compute_s: float | None = Field(default=None, ge=0)
    exposed_comm_s: float | None = Field(
        default=None, ge=0, description="Waiting on collectives with no compute running"
    )
    overlapped_comm_s: float | None = Field(
        default=None, ge=0, description="Collective time hidden behind compute"
    )
    idle_s: float | None = Field(default=None, ge=0)
    comm_source: Literal["hook", "profiler"] | None = None
    flops: float | None = Field(
        default=None, ge=0, description="Model FLOPs of the step on this rank"
    )
    mfu: float | None = Field(default=None, ge=0)
    peak_flops: float | None = Field(default=None, gt=0)
    flops_source: str | None = Field(default=None, max_length=128)
    peak_source: str | None = Field(default=None, max_length=255)
    mem_allocated_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX)
    mem_reserved_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX)
    rss_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX)
    flags: list[str] | None = Field(default=None, max_length=16, description="Spike flags")
    issues: dict[str, str] | None = None
    metrics: dict[str, float | None] | None = Field(
        default=None,
        description="User metrics (s.metric): name (^[a-z][a-z0-9_.]{0,31}$) to value, at "
        'most 32; NaN/Inf as for loss. Series "user.<name>"',
    )
    fingerprint: str | None = Field(
        default=None,
        pattern=FINGERPRINT_PATTERN,
        description="On a replica-checked step: the parameters' fingerprint after the "
        "optimizer step, 32 lowercase hex digits (agent/replica.py)",
    )
    replica_group: str | None = Field(
        default=None,
        max_length=1024,
        pattern=REPLICA_GROUP_PATTERN,
        description='The global ranks holding the same parameters, e.g. "0-7", "0-28:4", '
        '"3,9"; sent with the fingerprint',
    )

    probe: str | None = Field(
        default=None,
        pattern=FINGERPRINT_PATTERN,
        description="On a probed step (determinism_probe_every): the fingerprint of the "
        "model's output on the probe's fixed input, 32 lowercase hex digits "
        "(agent/probe.py); sent with the fingerprint",
    )
    probe_sums: (
        Annotated[
            list[Annotated[float, Field(allow_inf_nan=False)]],
            Field(min_length=3, max_length=3),
        ]
        | None
    ) = Field(
        default=None,
        description="The probe output's sum, L1 norm and signed sum (finite floats), "
        "compared within probe_rtol",
    )
    probe_rtol: float | None = Field(
        default=None,
        ge=0,
        le=0.1,
        description="How far the probe sums of two replicas may differ, relative to the "
        "L1 norm; absent or 0: the probes must be bit-identical",
    )

    samples_digest: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{16}$",
        description="s.samples(ids): an order-sensitive 64-bit digest of the step's sample "
        "ids on this rank, 16 lowercase hex digits (agent/samples.py)",
    )
    samples_count: int | None = Field(
        default=None, ge=0, le=65_536, description="How many sample ids the digest covers"
    )
    samples_epoch: int | None = Field(
        default=None,
        ge=0,
        le=2**31,
        description="The epoch of the step's sample ids (s.samples(ids, epoch=e)); sent "
        "with samples_digest",
    )
    samples_kept: list[int] | None = Field(
        default=None,
        max_length=65_536,
        description="With a dataset size: the step's sample ids for the epoch coverage check "
        "(all of them, or those of the dataset's fixed sample: agent/samples.py); sent with "
        "samples_digest",
    )
    data_sources: dict[str, Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = Field(
        default=None,
        description="s.data_source(name, tokens): the step's tokens from each data source; "
        f"names match {SOURCE_NAME}, at most {MAX_SOURCES}",
    )

    _ts_now = field_validator("ts")(_not_in_the_future)

    @model_validator(mode="after")
    def _probe_with_its_check(self) -> StepIn:
        if self.probe is not None and self.fingerprint is None:
            raise ValueError(PROBE_WITHOUT_CHECK)
        if self.samples_digest is None and (
            self.samples_kept is not None or self.samples_epoch is not None
        ):
            raise ValueError(SAMPLES_WITHOUT_DIGEST)
        return self

    @field_validator("samples_kept")
    @classmethod
    def _ids_in_int64(cls, ids: list[int] | None) -> list[int] | None:
        if ids:
            check_int64(ids)
        return ids

    @field_validator("data_sources")
    @classmethod
    def _source_names(cls, sources: dict[str, int] | None) -> dict[str, int] | None:
        if sources is not None:
            check_sources(sources)
        return sources

    @field_validator("metrics")
    @classmethod
    def _user_metrics(
        cls, metrics: dict[str, float | None] | None
    ) -> dict[str, float | None] | None:
        if not metrics:
            return None
        user_metrics.check(metrics)
        return metrics

    @field_validator(
        "ts",
        "duration_s",
        "fwd_s",
        "bwd_s",
        "opt_s",
        "other_s",
        "compute_s",
        "exposed_comm_s",
        "overlapped_comm_s",
        "idle_s",
        "flops",
        "mfu",
        "peak_flops",
    )
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


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
    _ts_now = field_validator("ts")(_not_in_the_future)
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


class GpuSampleIn(BaseModel):
    """One NVML reading of this rank's GPU. Fields a GPU or driver lacks are left out."""

    ts: float
    _ts_now = field_validator("ts")(_not_in_the_future)
    gpu_uuid: str | None = Field(default=None, max_length=64)
    gpu_name: str | None = Field(default=None, max_length=128)
    temp_c: float | None = None
    mem_temp_c: float | None = None
    power_w: float | None = Field(default=None, ge=0)
    power_limit_w: float | None = Field(default=None, ge=0)
    sm_clock_mhz: float | None = Field(default=None, ge=0)
    sm_clock_max_mhz: float | None = Field(default=None, ge=0)
    throttle: list[str] | None = Field(default=None, max_length=16)
    util_gpu: float | None = Field(default=None, ge=0, le=100)
    util_mem: float | None = Field(default=None, ge=0, le=100)
    mem_used_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX)
    mem_total_bytes: int | None = Field(default=None, ge=0, le=INT64_MAX)
    ecc_corrected: int | None = Field(default=None, ge=0, le=INT64_MAX)
    ecc_uncorrected: int | None = Field(default=None, ge=0, le=INT64_MAX)
    retired_pages: int | None = Field(default=None, ge=0, le=INT64_MAX)
    remapped_rows_correctable: int | None = Field(default=None, ge=0, le=INT64_MAX)
    remapped_rows_uncorrectable: int | None = Field(default=None, ge=0, le=INT64_MAX)
    remap_pending: bool | None = None
    pcie_replay: int | None = Field(default=None, ge=0, le=INT64_MAX)
    recovery_action: str | None = Field(default=None, max_length=32)
    simulated: bool = False


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


STEP_COLUMNS = frozenset(StepIn.model_fields)


def _agent_column_model() -> type[BaseModel]:
    """``AgentInfo`` turned column-wise (``world_size`` is the batch's): each field a list
    of its type with its constraints, validated in one pass, with no object a rank. A
    field with a default may be left out (every rank takes the default)."""
    fields: dict[str, Any] = {}
    for name, info in AgentInfo.model_fields.items():
        if name == "world_size":
            continue
        args = (info.annotation, *info.metadata)
        item = Annotated[args] if info.metadata else info.annotation  # type: ignore[valid-type]
        column = Annotated[list[item], Field(max_length=65_536)]  # type: ignore[valid-type]
        fields[name] = (column, ...) if info.is_required() else (column | None, None)
    return create_model(
        "AgentColumns",
        __doc__="The ranks' headers column-wise: a field of ``AgentInfo`` (but ``world_size``, "
        "the batch's) to a list with one value a rank, all lists of one length.",
        **fields,
    )


AgentColumns = _agent_column_model()
AGENT_FIELDS = tuple(AgentInfo.model_fields)
_AGENT_DEFAULTS = {
    name: info.default for name, info in AgentInfo.model_fields.items() if not info.is_required()
}
_AGENT_TIMES = ("started_at", "sent_at", "last_step_end")


class ColumnarBatch(BaseModel):
    """``POST /api/v1/ingest/columns``: several ranks' steps in one request, column-wise.

    For node relays and load generators: the ranks' headers come either as
    ``agents`` (one ``AgentInfo`` a rank in the request) or as ``agent_columns`` (the same
    fields column-wise: one list a field, a value a rank; cheaper to check and to store);
    ``steps`` maps a step field (as in ``StepIn``) plus ``rank`` to a list, all lists of
    one length. ``extras``: whole per-rank batches of the same run, for what has no columns
    (events, GPU samples): a node relay (``trainwarden relay``) sends its ranks' steps as
    columns and their events and GPU samples this way, all in one request.
    """

    run: str = Field(pattern=RUN_NAME_PATTERN)
    world_size: int = Field(ge=1, le=1_000_000)
    agents: list[AgentInfo] = Field(default_factory=list, max_length=65_536)
    agent_columns: AgentColumns | None = None  # type: ignore[valid-type]
    steps: dict[str, list[Any]] = Field(default_factory=dict)
    extras: list[IngestBatch] = Field(default_factory=list, max_length=4096)

    @model_validator(mode="before")
    @classmethod
    def _agents_share_the_world(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("agents"), list):
            data = {
                **data,
                "agents": [
                    {"world_size": data.get("world_size"), **a} if isinstance(a, dict) else a
                    for a in data["agents"]
                ],
            }
        return data

    @model_validator(mode="after")
    def _columns(self) -> ColumnarBatch:
        self._heads = self._header_columns()
        for i, extra in enumerate(self.extras):
            if extra.run != self.run:
                raise ValueError(
                    f"extras row {i}: run {extra.run!r} is not this batch's {self.run!r}"
                )
        if not self.steps:
            self._cols = {}
            return self
        unknown = set(self.steps) - STEP_COLUMNS - {"rank"}
        if unknown:
            raise ValueError(
                f"unknown step columns {sorted(unknown)}; known: {sorted(STEP_COLUMNS)}"
            )
        missing = {"rank", "step", "ts", "duration_s"} - set(self.steps)
        if missing:
            raise ValueError(f"missing step columns {sorted(missing)}")
        lengths = {name: len(values) for name, values in self.steps.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"step columns differ in length: {lengths}")
        if lengths["rank"] > MAX_RECORDS_PER_BATCH * 4:
            raise ValueError(f"at most {MAX_RECORDS_PER_BATCH * 4} step rows per request")
        heads = self._heads["rank"]
        if self.steps["rank"] != heads:  # else: a row a rank, in the headers' order
            stray = set(self.steps["rank"]) - set(heads)
            if stray:
                which = "agent_columns" if self.agent_columns is not None else "agents"
                raise ValueError(
                    f"step rows for ranks {sorted(stray)[:5]} that have no entry in {which}"
                )
        self._cols = _validate_columns(self.steps)  # every value checked here, at the edge
        return self

    def _header_columns(self) -> dict[str, list[Any]]:
        if self.agent_columns is None:
            if not self.agents:
                raise ValueError("no ranks: send their headers as agents or agent_columns")
            return {name: [getattr(a, name) for a in self.agents] for name in AGENT_FIELDS}
        if self.agents:
            raise ValueError("send the ranks' headers as agents or as agent_columns, not both")
        given = {name: v for name, v in self.agent_columns.__dict__.items() if v is not None}
        lengths = {name: len(values) for name, values in given.items()}
        n = lengths["rank"]
        if len(set(lengths.values())) != 1:
            raise ValueError(f"agent_columns differ in length: {lengths}")
        if not 1 <= n <= 65_536:
            raise ValueError(f"agent_columns: {n} ranks; from 1 to 65,536 a request")
        heads = {
            name: given.get(name) or [_AGENT_DEFAULTS[name]] * n
            if name != "world_size"
            else [self.world_size] * n
            for name in AGENT_FIELDS
        }
        ranks = heads["rank"]
        if max(ranks) >= self.world_size:
            i = next(i for i, rank in enumerate(ranks) if rank >= self.world_size)
            raise ValueError(
                f"agent_columns row {i}: rank {ranks[i]} is outside world_size {self.world_size}"
            )
        horizon = time.time() + MAX_FUTURE_S
        for name in _AGENT_TIMES:  # as AgentInfo checks each: after 1970, not a day ahead
            values = given.get(name)
            if not values:
                continue
            known = [t for t in values if t is not None] if None in values else values
            if known and all_finite(known) and min(known) >= MIN_TS and max(known) <= horizon:
                continue
            for i, ts in enumerate(values):
                if ts is not None:
                    try:
                        _not_in_the_future(ts)
                    except ValueError as exc:
                        raise ValueError(f"agent_columns row {i}: {name}: {exc}") from None
        return heads

    _cols: dict[str, list[Any]] = PrivateAttr(default_factory=dict)
    _heads: dict[str, list[Any]] = PrivateAttr(default_factory=dict)

    # The two below read the private attributes' dict directly: ``self._cols`` goes
    # through pydantic's __getattr__ (a Python call), and the writer asks per request.

    def columns(self) -> dict[str, list[Any]]:
        """The validated step columns: ``rank`` and the fields sent, all of one length
        (the writer keeps them column-wise: no object a row)."""
        return self.__pydantic_private__["_cols"]  # type: ignore[index]

    def header_columns(self) -> dict[str, list[Any]]:
        """The ranks' headers column-wise, whichever way they came: every ``AgentInfo``
        field (defaults filled in) to a list with a value a rank."""
        return self.__pydantic_private__["_heads"]  # type: ignore[index]

    def rows(self) -> list[tuple[int, dict[str, Any]]]:
        """(rank, step fields) pairs: the fields sent."""
        cols = dict(self._cols)
        ranks = cols.pop("rank", [])
        names = list(cols)
        return [
            (rank, dict(zip(names, values, strict=True)))
            for rank, values in zip(ranks, zip(*cols.values(), strict=True), strict=True)
        ]


def _column_model() -> type[BaseModel]:
    """``StepIn`` turned column-wise: each field a list of its type with its constraints,
    so a node's rows are validated in one pass instead of one model per row."""
    fields: dict[str, Any] = {"rank": (list[Annotated[int, Field(ge=0)]], ...)}
    for name, info in StepIn.model_fields.items():
        args = (info.annotation, *info.metadata)
        item = Annotated[args] if info.metadata else info.annotation  # type: ignore[valid-type]
        fields[name] = (list[item] | None, None)  # type: ignore[valid-type]
    return create_model("StepColumns", **fields)


_STEP_COLUMNS_MODEL = _column_model()
_FINITE_COLUMNS = tuple(
    name
    for name in StepIn.model_fields
    if name not in ("loss", "grad_norm")
    and StepIn.model_fields[name].annotation in (float, float | None)
)
_NONFINITE_WORDS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _validate_columns(steps: dict[str, list[Any]]) -> dict[str, list[Any]]:
    for name in ("loss", "grad_norm"):  # NaN/Inf may come as words, as in ``StepIn``
        values = steps.get(name)
        if values and str in map(type, values):
            steps = {
                **steps,
                name: [_NONFINITE_WORDS.get(v, v) if isinstance(v, str) else v for v in values],
            }
    try:
        cols = _STEP_COLUMNS_MODEL.model_validate(steps)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        loc = error["loc"]
        field = ".".join(map(str, (loc[0], *loc[2:])))  # a user metric's key follows its row
        where = f"steps row {loc[1]}: {field}" if len(loc) > 1 else f"steps: {loc[0]}"
        raise ValueError(f"{where}: {error['msg']}") from None
    fields = cols.__dict__
    columns = {name: fields[name] for name in steps}
    if columns.get("metrics"):
        user_metrics.check_column(columns["metrics"])
    finite = [values for name in _FINITE_COLUMNS if (values := columns.get(name))]
    if not all_finite(itertools.chain.from_iterable(finite)):  # one C loop for them all
        for name in _FINITE_COLUMNS:  # the column and row at fault
            values = columns.get(name)
            if values and not all_finite(values):
                for i, value in enumerate(values):
                    if value is not None and not math.isfinite(value):
                        raise ValueError(f"steps row {i}: {name}: must be a finite number")
    kept, epochs = columns.get("samples_kept"), columns.get("samples_epoch")
    if kept or epochs:
        digests = columns.get("samples_digest") or [None] * len(columns["ts"])
        for i, digest in enumerate(digests):
            if digest is None and (
                (kept is not None and kept[i] is not None)
                or (epochs is not None and epochs[i] is not None)
            ):
                raise ValueError(f"steps row {i}: {SAMPLES_WITHOUT_DIGEST}")
    for i, ids in enumerate(kept or ()):
        if ids:
            try:
                check_int64(ids)
            except ValueError as exc:
                raise ValueError(f"steps row {i}: {exc}") from None
    if columns.get("data_sources"):
        for i, sources in enumerate(columns["data_sources"]):
            if sources:
                try:
                    check_sources(sources)
                except ValueError as exc:
                    raise ValueError(f"steps row {i}: {exc}") from None
    if columns.get("probe"):
        prints = columns.get("fingerprint") or [None] * len(columns["probe"])
        for i, (probe, fp) in enumerate(zip(columns["probe"], prints, strict=True)):
            if probe is not None and fp is None:
                raise ValueError(f"steps row {i}: {PROBE_WITHOUT_CHECK}")
    horizon = time.time() + MAX_FUTURE_S
    ts = columns["ts"]
    if not MIN_TS <= min(ts) <= max(ts) <= horizon:
        i = next(i for i, t in enumerate(ts) if not MIN_TS <= t <= horizon)
        try:
            _not_in_the_future(ts[i])
        except ValueError as exc:
            raise ValueError(f"steps row {i}: ts: {exc}") from None
    return columns


def all_finite(values: Iterable[Any]) -> bool:
    """Whether every number in ``values`` (None aside) is finite, in one C loop: a sum is
    finite when its terms are. False may be wrong (a sum that overflows, a non-number):
    then look row by row."""
    try:
        return math.isfinite(sum(filter(None, values)))
    except TypeError:
        return False


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
