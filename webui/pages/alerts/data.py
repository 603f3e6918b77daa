"""What the alerts page reads through the client at each refresh: its three tables."""

from __future__ import annotations

from typing import Any

from ...client import Client
from .panels import ALERTS_SHOWN, actions_table, alerts_table, silences_table

ACTIONS_SHOWN = 50


def page_parts(
    client: Client, *, run: str | None, states: list[str], now: float
) -> tuple[Any, ...]:
    found = client.alerts(run=run, states=states, limit=ALERTS_SHOWN) if states else []
    return (
        alerts_table(found, now=now, run=run, states=states),
        silences_table(client.silences(), now=now),
        actions_table(client.actions(run=run, limit=ACTIONS_SHOWN), now=now, run=run),
    )
