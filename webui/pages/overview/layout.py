"""The run overview, ``/runs/<name>``: one stacked figure on a shared x-axis, the run's
facts, its open alerts and its ranks' states.

The view (range of steps, step or time axis, a rank to draw) lives in the query string
(:mod:`.query`), ``?from=100&to=900&axis=time&rank=3``, so a link opens what its sender
saw. A range selected on the figure is read again from the collector at full detail
(``from``/``to``, at most :data:`.data.POINTS` points a series, downsampled on the server
so spikes survive). Component ids start with ``run-``.
"""

from __future__ import annotations

from dash import dcc, html

from ...charts import placeholder
from ...components import run_tabs
from .query import parse_query


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    view = parse_query(search)
    toolbar = html.Div(
        [
            dcc.RadioItems(
                id="run-axis",
                options=[{"label": " step", "value": "step"}, {"label": " time", "value": "time"}],
                value=view["axis"],
                inline=True,
                className="run-axis",
            ),
            html.Label(
                [
                    "rank ",
                    dcc.Input(
                        id="run-rank",
                        type="number",
                        min=0,
                        step=1,
                        value=view["rank"],
                        debounce=True,
                        placeholder="all",
                        className="run-rank",
                    ),
                ],
                title="Draw one rank's loss over the band",
            ),
            html.Button(
                "Whole run",
                id="run-reset",
                className="btn btn-small",
                title="Show every step (or double-click the plot)",
            ),
            html.Span(id="run-range", className="hint run-range"),
        ],
        className="run-toolbar",
    )
    return html.Div(
        [
            # The query string as the browser has it: the view is drawn from it already, and
            # the figure's first callback does not wait on a sync() that would change nothing.
            dcc.Location(id="run-url", refresh=False, search=search),
            dcc.Store(id="run-name", data=name),
            dcc.Store(id="run-view", data=view),
            dcc.Store(id="run-xmap"),
            dcc.Store(id="run-drag"),  # the newest drag (x range) on the chart: see sync
            dcc.Store(id="run-tick"),  # the refresh ticks the charts take: see gestures
            dcc.Store(id="run-drawn"),  # set once the chart's first figure is back
            html.Div(id="run-header", children=html.H2(name)),
            run_tabs(name, "Overview"),
            html.Div(id="run-notice"),
            html.Div(id="run-alerts"),
            toolbar,
            dcc.Graph(
                id="run-overview",
                figure=placeholder("Loading…"),
                config={"displaylogo": False, "doubleClick": "autosize"},
            ),
            html.Div(
                [
                    html.Span("Your metric ", className="fact-key"),
                    # RadioItems, not a Dropdown: dcc's Dropdown is a chunk loaded on demand, and
                    # loading it slowed the overview's first drawing.
                    dcc.RadioItems(
                        id="run-user-metric", options=[], inline=True, className="user-pick"
                    ),
                ],
                className="run-user-pick",
                style={"margin": "0.5rem 0"},
            ),
            dcc.Graph(
                id="run-user",
                figure=placeholder("Loading…"),
                config={"displaylogo": False},
            ),
            html.Div(id="run-ranks"),
            dcc.Interval(id="run-interval", interval=int(refresh_s * 1000)),
        ]
    )
