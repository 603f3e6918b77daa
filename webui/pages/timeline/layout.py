"""The timeline page of a run, ``/runs/<name>/timeline``: its incidents, one incident's
ordered entries (alerts, pages, actions, events, checkpoints, restarts, rollbacks,
evictions, notes) with its derived figures, the post-mortem downloads, and the logbook.

``?incident=3`` selects an incident (share the URL, :mod:`.query`); without it the page
shows the whole run's timeline. What it draws comes from :mod:`.panels` and
:mod:`.figures`; notes, closing and retitling go through the client to the API's own
route functions (:mod:`.actions`; with auth on, an ``admin`` session's only; the name
field records who did it).
"""

from __future__ import annotations

from dash import dcc, html

from ...charts import placeholder
from ...components import field, notice, run_tabs
from .data import HIDDEN


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    note_form = [
        field(
            "Your name",
            dcc.Input(
                id="tl-author",
                placeholder="e.g. ana",
                maxLength=128,
                persistence=True,
                persistence_type="local",
            ),
        ),
        field(
            "Note",
            dcc.Input(
                id="tl-note-text",
                placeholder="e.g. restarted node3's NCCL by hand",
                maxLength=10_000,
                debounce=False,
            ),
            wide=True,
        ),
        html.Button("Add note", id="tl-note-add", className="btn btn-primary", n_clicks=0),
    ]
    tools = [
        field(
            "Title", dcc.Input(id="tl-retitle-title", placeholder="a better title", maxLength=200)
        ),
        html.Button("Retitle", id="tl-retitle", className="btn", n_clicks=0),
        html.Div(
            [  # an open incident's only
                field(
                    "Summary",
                    dcc.Input(
                        id="tl-close-summary",
                        placeholder="what happened, in a line",
                        maxLength=2000,
                    ),
                    wide=True,
                ),
                html.Button("Close incident", id="tl-close", className="btn", n_clicks=0),
            ],
            id="tl-close-tools",
            className="toolbar tl-close-tools",
            style=HIDDEN,
        ),
    ]
    return html.Div(
        [
            dcc.Location(id="tl-url", refresh=False),
            dcc.Store(id="tl-run", data=name),
            html.H2(name),
            run_tabs(name, "Timeline"),
            html.Div(id="tl-notice", role="status"),
            html.H3("Incidents"),
            html.Div(id="tl-incidents", children=notice("Loading incidents…")),
            html.Div(id="tl-header"),
            html.Div(id="tl-downloads"),
            html.Div(id="tl-figures"),
            html.H3("Logbook"),
            html.P(
                "A note is kept with the run and shown in its timeline; it joins the incident "
                "shown here, else the run's open incident.",
                className="hint",
            ),
            html.Div(note_form, className="toolbar"),
            html.Div(tools, id="tl-tools", className="toolbar", style=HIDDEN),
            html.Div(id="tl-feedback", role="status"),
            html.H3("Timeline"),
            dcc.Graph(id="tl-chart", config={"displaylogo": False}, figure=placeholder("Loading…")),
            html.Div(id="tl-entries"),
            dcc.Store(id="tl-changed", data=0),
            dcc.Store(id="tl-digest"),
            dcc.Interval(id="tl-interval", interval=int(max(refresh_s, 2.0) * 1000)),
            dcc.Store(id="tl-tick"),  # its ticks, held while a pointer is down on the chart
        ]
    )
