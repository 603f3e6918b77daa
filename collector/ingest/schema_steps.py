"""The step record of the ingest wire format: one rank's record of one step (``StepIn``)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from trainwarden.collector.ingest import user_metrics
from trainwarden.collector.ingest.schema_checks import (
    FINGERPRINT_PATTERN,
    INT64_MAX,
    MAX_SOURCES,
    PROBE_WITHOUT_CHECK,
    REPLICA_GROUP_PATTERN,
    SAMPLES_WITHOUT_DIGEST,
    SOURCE_NAME,
    check_int64,
    check_sources,
    not_in_the_future,
)


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

    _ts_now = field_validator("ts")(not_in_the_future)

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
