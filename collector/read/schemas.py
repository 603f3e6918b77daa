"""What the read API answers: runs, ranks, series, events, heatmaps (the response models
the UI and other tools read)."""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from trainwarden.collector.ingest.schema_gpu import GpuSampleIn


class RunSummary(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    status: str
    world_size: int
    ranks_seen: int
    last_step: int | None
    created_at: float
    updated_at: float


class RankInfo(BaseModel):
    rank: int
    heartbeat_s: float | None = None
    progress_at: float | None = None
    in_step: bool | None = None
    phase: str | None = None
    state_since: float | None = None
    state_detail: dict[str, Any] | None = None
    clock_skew_s: float | None = None
    gpu: dict[str, Any] | None = None
    local_rank: int | None
    host: str | None
    node: str | None
    pid: int | None
    session: str
    state: str
    first_seen: float
    last_seen: float
    last_step: int | None


class RunDetail(RunSummary):
    ranks: list[RankInfo]
    metrics: list[str]


class RunMetrics(BaseModel):
    """The series names a run has (``GET /api/v1/runs/{run}/series?metric=...``)."""

    run: str
    builtin: list[str] = Field(description="Metrics every run has (step_time, loss, ...)")
    user: list[str] = Field(
        description="The run's user metrics (s.metric), as user.<name>, once rolled up"
    )


class EventOut(BaseModel):
    id: int
    kind: str
    severity: str
    ts: float
    recv_ts: float = Field(description="When the collector received it")
    rank: int | None
    step: int | None
    data: dict[str, Any] | None


class Series(BaseModel):
    """One metric per step across ranks, column-wise (ready for plotting)."""

    run: str
    metric: str
    unit: str
    step: list[int]
    ts: list[float]
    n: list[int]
    min: list[float | None]
    median: list[float | None]
    max: list[float | None]
    total: list[float | None]
    argmax_rank: list[int | None]
    p99: list[float | None] = Field(
        default_factory=list, description="99th percentile across ranks (interpolated)"
    )
    bucket: int = Field(default=1, description="Steps per point (1: not downsampled)")


class ReplacedSeries(BaseModel):
    """Executions of steps that a later execution replaced (a rollback or a restart ran
    the steps again; the series keeps the latest), per step across ranks, column-wise:
    where a spike that was rolled back still shows."""

    run: str
    metric: str
    unit: str
    step: list[int] = Field(description="the step (downsampled: the bucket's first step)")
    ts: list[float] = Field(description="when the point's first replaced execution started")
    n: list[int] = Field(description="replaced executions in the point (ranks x times)")
    min: list[float | None]
    mean: list[float | None]
    max: list[float | None]
    bucket: int = Field(default=1, description="Steps per point (1: not downsampled)")


class RankSeries(BaseModel):
    """One metric of one rank, per step."""

    run: str
    metric: str
    unit: str
    rank: int
    step: list[int]
    ts: list[float]
    value: list[float | None]


class FlaggedStep(BaseModel):
    """A step on which a rank raised spike flags (grad-norm spike, loss spike, non-finite)."""

    step: int
    rank: int
    flags: list[str]
    loss: float | None
    grad_norm: float | None


class GpuSample(GpuSampleIn):
    """A stored NVML reading of one rank's GPU."""

    rank: int


class Heatmap(BaseModel):
    """One metric per rank x step bucket (the bucket's max: a slow step stands out)."""

    run: str
    metric: str
    unit: str
    ranks: list[int]
    step_start: list[int]
    bucket: int
    values: list[list[float | None]]


class ReplicaResult(BaseModel):
    """One comparison of a checked step's fingerprints within one replica group."""

    step: int
    replica_group: str = Field(description="The group's global ranks, e.g. 0-7, 0-28:4, 3,9")
    agree: bool
    suspects: list[int] = Field(description="Ranks outside the majority (all, with none)")
    missing: list[int] = Field(description="Members that sent no fingerprint: left out")
    fingerprints: int = Field(description="How many were compared")
    probe_suspects: list[int] | None = Field(
        default=None,
        description="On a probed step: the ranks whose determinism probe (the output on a "
        "fixed input) left the majority; null: no probe at this step",
    )
    probes: int | None = Field(default=None, description="How many probes were compared")
    decided_at: float
