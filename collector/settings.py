"""Collector settings: command-line flag, else ``TRAINWARDEN_*`` variable, else default."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from .db import default_db_url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINWARDEN_", extra="ignore")

    db: str = Field(default_factory=default_db_url, description="SQLAlchemy URL (TRAINWARDEN_DB)")
    host: str = Field(default="127.0.0.1", description="Address to listen on (TRAINWARDEN_HOST)")
    port: int = Field(default=8000, ge=1, le=65535, description="Port (TRAINWARDEN_PORT)")
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description="Largest request body (TRAINWARDEN_MAX_BODY_BYTES)",
    )
    max_inflight_ingest: int = Field(
        default=2048,
        ge=1,
        description="Ingest requests in progress (reading, validating or waiting for their "
        "commit) at most; more get 503 + Retry-After before their body is read",
    )
    max_pending_rows: int = Field(
        default=100_000,
        ge=1,
        description="Records waiting for the writer at most; past it ingest gets 503 + Retry-After",
    )
    external_url: str | None = Field(
        default=None,
        description="The URL people reach this collector at (TRAINWARDEN_EXTERNAL_URL): "
        "runbook links in alerts and pages are made absolute with it",
    )
    ui_refresh_s: float = Field(
        default=2.0, gt=0, description="How often the UI polls for new data"
    )
    price_per_gpu_hour: float | None = Field(
        default=None,
        ge=0,
        description="What a GPU-hour costs, for the cost lost in post-mortems "
        "(TRAINWARDEN_PRICE_PER_GPU_HOUR); without it the cost is not shown",
    )
    incident_cooldown_s: float = Field(
        default=300.0,
        ge=0,
        description="An incident closes this long after its last alert resolved and its "
        "last action ended (TRAINWARDEN_INCIDENT_COOLDOWN_S)",
    )
    postmortem_post: str | None = Field(
        default=None,
        description="Post each incident's report to this Slack-compatible or generic webhook "
        "when it closes (TRAINWARDEN_POSTMORTEM_POST)",
    )
