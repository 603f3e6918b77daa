"""The hardware page of a run, ``/runs/<name>/hardware``: per node / GPU temperature, power,
clocks, throttling, ECC and XID events, and the ranks' preflight (as on the Ranks page).

``?rank=N`` narrows the page to that rank's GPU (its links come from the ranks page).
"""

from __future__ import annotations

from dash import dcc, html

from ...charts import empty_figure
from ...components import notice, run_tabs
from .data import GRAPHS


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    graph = {"config": {"displaylogo": False}, "figure": empty_figure("Loading…")}
    return html.Div(
        [
            dcc.Location(id="hw-url", refresh=False),
            dcc.Store(id="hw-run", data=name),
            html.H2(name),
            run_tabs(name, "Hardware"),
            html.Div(id="hw-notice", role="status"),
            html.H3("GPUs by node"),
            html.Div(id="hw-gpus", children=notice("Loading GPUs…")),
            html.H3("XID errors"),
            html.Div(id="hw-xids"),
            html.Div(id="hw-preflight"),  # the checks before step 0, when the run ran them
            *[dcc.Graph(id=f"hw-{key}", **graph) for key in GRAPHS],
            dcc.Interval(id="hw-interval", interval=int(max(refresh_s, 2.0) * 1000)),
            dcc.Store(id="hw-tick"),  # its ticks, held while a pointer is down on a graph
        ]
    )
