"""The runs list, ``/`` (and ``/runs``): a table of every run, refreshed live."""

from __future__ import annotations

from dash import dcc, html

from ...components import notice


def layout() -> html.Div:
    return html.Div(
        [
            html.H2("Runs"),
            html.Div(id="runs-table", children=notice("Loading runs…")),
            dcc.Interval(id="runs-interval", interval=5_000),
        ]
    )
