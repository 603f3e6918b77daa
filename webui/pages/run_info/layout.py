"""The run page, ``/runs/<name>/info``: what the run is (config, tags, data snapshot,
code version, environment), its attempts, its goodput (ETTR and where the rest of the
allocation went), its checkpoints and the cadence advisor, what it trained on (epoch
coverage, the data mixture, data events) and a diff against another run. What it draws
comes from :mod:`.panels`, :mod:`.figures` and :mod:`.data_panel`; the data from the
collector's run identity, economics and data routes, called in-process through the
client (:mod:`.data`).

A live refresh redraws only the parts whose content changed, so a scrolled config table
or a chosen comparison stays as the user left it.
"""

from __future__ import annotations

from dash import dcc, html

from ...components import notice, run_tabs
from .figures import breakdown_figure

REFRESH_S = 5.0  # economics change slowly; each refresh reads the run's step rollups


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    return html.Div(
        [
            dcc.Store(id="ri-run", data=name),
            html.H2(name),
            run_tabs(name, "Run"),
            html.Div(id="ri-notice", role="status"),
            html.H3("Goodput"),
            html.Div(id="ri-goodput", children=notice("Loading goodput…")),
            dcc.Graph(
                id="ri-breakdown",
                config={"displaylogo": False, "displayModeBar": False},
                figure=breakdown_figure(None, theme=None, revision=name),
            ),
            html.H3("Checkpoints and cadence"),
            html.Div(id="ri-checkpoints"),
            html.H3("Data"),
            html.Div(id="ri-data"),
            html.H3("Attempts"),
            html.Div(id="ri-attempts"),
            html.H3("Identity"),
            html.Div(id="ri-identity"),
            html.H3("Compare with another run"),
            html.Div(
                dcc.Dropdown(
                    id="ri-compare",
                    placeholder="Pick a run to compare its config, code, environment and packages",
                    clearable=True,
                ),
                className="ri-compare",
            ),
            html.Div(id="ri-diff"),
            dcc.Store(id="ri-digests", data={}),
            dcc.Interval(id="ri-interval", interval=int(max(refresh_s, REFRESH_S) * 1000)),
        ]
    )
