"""The hardware page of a run, ``/runs/<name>/hardware``: per node / GPU temperature, power, clocks, throttling, ECC and XID events."""

from __future__ import annotations

from typing import Any

import dash
from dash import html

from .client import Client
from .components import notice, run_tabs


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    return html.Div(
        [
            html.H2(name),
            run_tabs(name, "Hardware"),
            html.Div(id="hw-body", children=notice("Hardware: not built yet.")),
        ]
    )


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks (component ids start with ``hw-``)."""
    _ = (app, client)


__all__: list[Any] = ["layout", "register"]
