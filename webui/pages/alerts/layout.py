"""The alerts page, ``/alerts``: its filters (run, states, your name), the alerts, the
silence form and the silences, the actions. What it draws comes from :mod:`.panels`, its
URL from :mod:`.query`, what its buttons do from :mod:`.actions`."""

from __future__ import annotations

from collections.abc import Sequence

from dash import dcc, html

from ...components import field, notice
from .query import STATES, parse_query

DURATIONS = [
    ("30 min", 1800),
    ("1 hour", 3600),
    ("4 hours", 14_400),
    ("12 hours", 43_200),
    ("1 day", 86_400),
    ("3 days", 259_200),
    ("7 days", 604_800),
]


def layout(search: str | None, *, runs: Sequence[str], refresh_s: float) -> html.Div:
    run, states = parse_query(search)
    options = sorted({*runs, *([run] if run else [])})
    filters = [
        field(
            "Run",
            dcc.Dropdown(
                id="alerts-run", options=options, value=run, placeholder="All runs", clearable=True
            ),
            wide=True,
        ),
        field(
            "State",
            dcc.Checklist(
                id="alerts-states",
                options=list(STATES),
                value=states,
                inline=True,
                className="checks",
            ),
        ),
        field(
            "Your name",
            dcc.Input(
                id="alerts-by",
                placeholder="e.g. ana",
                maxLength=128,
                persistence=True,
                persistence_type="local",
            ),
        ),
    ]
    silence_form = [
        field("Run", dcc.Input(id="alerts-silence-run", placeholder="run name", value=run or "")),
        field("Rank", dcc.Input(id="alerts-silence-rank", placeholder="any", inputMode="numeric")),
        field("Alert name", dcc.Input(id="alerts-silence-alertname", placeholder="e.g. FatalXid")),
        field(
            "For",
            dcc.Dropdown(
                id="alerts-silence-duration",
                value=3600,
                clearable=False,
                searchable=False,
                options=[{"label": k, "value": v} for k, v in DURATIONS],
            ),
        ),
        field(
            "Why",
            dcc.Input(
                id="alerts-silence-comment", placeholder="e.g. node7 in maintenance", maxLength=1000
            ),
            wide=True,
        ),
        html.Button("Silence", id="alerts-silence-submit", className="btn btn-primary", n_clicks=0),
    ]
    return html.Div(
        [
            # The page's own view of the URL: no reload when the filters write it.
            dcc.Location(id="alerts-url", refresh=False),
            html.H2("Alerts"),
            html.Div(filters, className="toolbar"),
            html.Div(id="alerts-feedback", role="status"),
            html.Div(id="alerts-table", children=notice("Loading alerts…")),
            html.H3("Silence alerts"),
            html.P(
                "Silenced alerts are still evaluated and listed; nobody is paged for them. "
                "“Silence…” on an alert fills this in.",
                className="hint",
            ),
            html.Div(silence_form, className="toolbar silence-form"),
            html.H3("Silences"),
            html.Div(id="alerts-silences"),
            html.H3("Actions"),
            html.Div(id="alerts-actions"),
            dcc.Store(id="alerts-changed", data=0),
            dcc.Store(id="alerts-digest"),
            dcc.Interval(id="alerts-interval", interval=int(refresh_s * 1000)),
        ]
    )
