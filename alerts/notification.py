"""What the alert engine tells the notifiers about one alert: it fires (or is re-sent),
or it resolved. Storm grouping (``grouping.py``) groups these; the collector's notifiers
(``collector/alerting/notify/``) deliver them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Notification:
    """What the engine says about one alert: it fires (or is re-sent), or it resolved."""

    alert_id: int
    fingerprint: str
    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None
    generator_url: str | None = None

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")
