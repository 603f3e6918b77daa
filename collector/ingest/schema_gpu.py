"""The GPU sample of the ingest wire format: one NVML reading of a rank's GPU."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from trainwarden.collector.ingest.schema_checks import INT64_MAX, not_in_the_future


class GpuSampleIn(BaseModel):
    """One NVML reading of this rank's GPU. Fields a GPU or driver lacks are left out."""

    ts: float
    _ts_now = field_validator("ts")(not_in_the_future)
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
