"""The step record of the ingest wire format: one rank's record of one step (``StepIn``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, create_model, field_validator, model_validator

from trainwarden.agent.metric_catalog import FIELDS
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


class _StepRecord(BaseModel):
    """One rank's record of one step."""

    step: int = Field(ge=0, le=2**62)
    ts: float = Field(description="Wall-clock start of the step, epoch seconds")
    comm_source: Literal["hook", "profiler"] | None = None
    flops_source: str | None = Field(default=None, max_length=128)
    peak_source: str | None = Field(default=None, max_length=255)
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
    def _probe_with_its_check(self) -> _StepRecord:
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
        "ts", *(f.name for f in FIELDS if not f.integer and not f.words), check_fields=False
    )
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


def _catalog_fields() -> dict[str, Any]:
    """Each number of the metric catalog as a field: its type, its limits, its default."""
    fields: dict[str, Any] = {}
    for f in FIELDS:
        limits: dict[str, Any] = {"description": f.description}
        if f.positive:
            limits["gt"] = 0
        elif f.minimum is not None:
            limits["ge"] = f.minimum
        if f.integer:
            limits["le"] = INT64_MAX
        kind: Any = int if f.integer else float
        if f.required:
            fields[f.name] = (kind, Field(**limits))
        else:
            fields[f.name] = (kind | None, Field(default=None, **limits))
    return fields


if TYPE_CHECKING:
    StepIn = _StepRecord
else:
    StepIn = create_model(
        "StepIn",
        __base__=_StepRecord,
        __doc__=_StepRecord.__doc__,
        __module__=__name__,
        **_catalog_fields(),
    )
    """One rank's record of one step: the fields above and each number of the metric
    catalog (``trainwarden.agent.metric_catalog.FIELDS``)."""
