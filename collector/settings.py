"""Collector settings: command-line flag, else ``TRAINWARDEN_*`` variable, else default."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainwarden.collector.api.auth import AuthSettings
from trainwarden.collector.store.db import default_db_url


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINWARDEN_", extra="ignore")

    db: str = Field(default_factory=default_db_url, description="SQLAlchemy URL (TRAINWARDEN_DB)")
    host: str = Field(default="127.0.0.1", description="Address to listen on (TRAINWARDEN_HOST)")
    port: int = Field(
        default=8000, ge=0, le=65535, description="Port (TRAINWARDEN_PORT); 0: a free one, said"
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Collector processes on the one port (TRAINWARDEN_WORKERS); more than one "
        "needs PostgreSQL",
    )
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
    max_queue_wait_s: float = Field(
        default=1.0,
        gt=0,
        description="How long the oldest request waiting for the writer may wait "
        "(TRAINWARDEN_MAX_QUEUE_WAIT_S); past it new ingest requests get 503 + Retry-After, "
        "so that past capacity what is accepted stays fresh",
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
    mtbf_hours: float | None = Field(
        default=None,
        gt=0,
        description="The mean time between interruptions of a job (TRAINWARDEN_MTBF_HOURS), "
        "for the checkpoint cadence advisor while a run has had too few of its own",
    )
    gpu_mtbf_hours: float = Field(
        default=50_000.0,
        gt=0,
        description="Without --mtbf-hours: a GPU's MTBF; a job of N GPUs is interrupted "
        "every gpu_mtbf_hours / N (TRAINWARDEN_GPU_MTBF_HOURS)",
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
    auth: Literal["required", "off"] = Field(
        default="required",
        description="required: the API needs tokens and the UI a login (TRAINWARDEN_AUTH); "
        "off: anyone who reaches the port may read, send and act",
    )
    trusted_user_header: str | None = Field(
        default=None,
        description="A header an authenticating reverse proxy sets to the user's name, "
        "trusted for the web UI (TRAINWARDEN_TRUSTED_USER_HEADER, e.g. X-Forwarded-User)",
    )
    trusted_user_scope: Literal["read", "admin"] = Field(
        default="admin", description="What a user named by the trusted header may do in the UI"
    )
    token_rate: float = Field(
        default=2000.0,
        ge=0,
        description="Requests a second each token may make on average; 0: no limit "
        "(TRAINWARDEN_TOKEN_RATE)",
    )
    token_burst: int = Field(
        default=10_000, ge=1, description="Requests a token may make at once above its rate"
    )
    token_cache_s: float = Field(
        default=5.0,
        ge=0,
        le=300,
        description="How long a token is trusted before it is read again: a revocation "
        "takes effect within this (TRAINWARDEN_TOKEN_CACHE_S)",
    )
    session_secret: str | None = Field(
        default=None,
        description="Signs UI session cookies (TRAINWARDEN_SESSION_SECRET); give every "
        "replica the same one; default: random per process (a restart ends sessions)",
    )
    metrics_auth: bool = Field(
        default=False,
        description="/metrics needs a token with read too (TRAINWARDEN_METRICS_AUTH); "
        "default: open, for Prometheus",
    )
    ssl_certfile: str | None = Field(
        default=None, description="Serve HTTPS with this certificate (PEM)"
    )
    ssl_keyfile: str | None = Field(default=None, description="... and this private key (PEM)")

    def auth_settings(self) -> AuthSettings | None:
        """The :class:`~.auth.AuthSettings` of ``auth=required``, else None."""
        if self.auth == "off":
            return None
        made = AuthSettings(
            trusted_user_header=self.trusted_user_header,
            trusted_user_scope=self.trusted_user_scope,
            cache_ttl_s=self.token_cache_s,
            rate_per_s=self.token_rate,
            burst=self.token_burst,
            metrics_scope="read" if self.metrics_auth else None,
        )
        if self.session_secret:
            made.session_secret = self.session_secret.encode()
        return made
