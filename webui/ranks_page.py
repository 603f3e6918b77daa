"""The ranks page of a run, ``/runs/<name>/ranks``: rank x step heatmaps, rank states, one rank's detail."""

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
            run_tabs(name, "Ranks"),
            html.Div(id="ranks-body", children=notice("Ranks: not built yet.")),
        ]
    )


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks (component ids start with ``ranks-``)."""
    _ = (app, client)


__all__: list[Any] = ["layout", "register"]
