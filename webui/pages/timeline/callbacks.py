"""The timeline page of a run, ``/runs/<name>/timeline``: its incidents, one incident's
ordered entries (alerts, pages, actions, events, checkpoints, restarts, rollbacks,
evictions, notes) with its derived figures, the post-mortem downloads, and the logbook.

``?incident=3`` selects an incident (share the URL); without it the page shows the whole
run's timeline. What it draws comes from :mod:`.timeline`; notes, closing and retitling
go through the client to the API's own route functions (with auth on, an ``admin``
session's only; the name field records who did it).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import dash
from dash import Input, Output, State, dcc, html

from trainwarden.collector.read.queries import NotFound

from ...charts import empty_figure, placeholder, themed
from ...client import Client, Refused
from ...components import digest, notice, run_tabs
from ...gestures import hold_while_pointing
from . import panels as view

log = logging.getLogger(__name__)
PARTS = ("tl-notice", "tl-incidents", "tl-header", "tl-downloads", "tl-figures", "tl-entries")
BUTTONS = ("tl-note-add", "tl-retitle", "tl-close")
HIDDEN: dict[str, str] = {"display": "none"}  # the incident tools, until one is picked
SHOWN: dict[str, str] = {}


def _field(label: str, control: Any, *, wide: bool = False) -> html.Label:
    return html.Label(
        [html.Span(label, className="field-label"), control],
        className="field field-wide" if wide else "field",
    )


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    note_form = [
        _field(
            "Your name",
            dcc.Input(
                id="tl-author",
                placeholder="e.g. ana",
                maxLength=128,
                persistence=True,
                persistence_type="local",
            ),
        ),
        _field(
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
        _field(
            "Title", dcc.Input(id="tl-retitle-title", placeholder="a better title", maxLength=200)
        ),
        html.Button("Retitle", id="tl-retitle", className="btn", n_clicks=0),
        html.Div(
            [  # an open incident's only
                _field(
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


def page_parts(
    client: Client, name: str, search: str | None, theme: str | None, *, now: float
) -> tuple[Any, ...]:
    """(notice, incidents, header, downloads, figures, entries, chart, the incident tools'
    style, the close tools' style)."""
    wanted, problem = view.parse_query(search)
    incidents = client.incidents(name, merged=True)  # NotFound: no such run
    by_id = {i.id: i for i in incidents}
    said = [problem] if problem else []
    chosen = by_id.get(wanted) if wanted is not None else None
    if wanted is not None and chosen is None:
        said.append(
            f"Run {name!r} has no incident {wanted}; showing the whole run. "
            "Pick one of its incidents above."
        )
    elif chosen is not None and chosen.state == "merged" and chosen.merged_into in by_id:
        said.append(
            f"Incident {chosen.id} was merged into incident {chosen.merged_into}; showing that one."
        )
        chosen = by_id[chosen.merged_into]
    selected = chosen.id if chosen is not None else None
    tl = client.timeline(name, incident=selected)
    figures = tl.get("figures")
    origin = None
    if figures:
        origin = (
            figures.get("fault_at")
            if figures.get("fault_at") is not None
            else figures.get("pending_at")
        )
    listed = [i for i in incidents if i.state != "merged"]
    return (
        notice(" ".join(said), "error") if said else None,
        view.incidents_list(listed, run=name, selected=selected, now=now),
        view.incident_header(chosen, now=now),
        view.downloads(name, selected),
        view.figures_card(figures, tl.get("definitions") or {}) if chosen is not None else None,
        view.entries_table(tl["entries"], now=now, origin=origin),
        view.timeline_figure(tl["entries"], figures, theme=theme, revision=f"{name}:{selected}"),
        SHOWN if chosen is not None else HIDDEN,
        SHOWN if chosen is not None and chosen.state == "open" else HIDDEN,
    )


def perform(
    client: Client,
    button: str,
    *,
    run: str,
    incident: int | None,
    by: str | None,
    text: str | None = None,
    title: str | None = None,
    summary: str | None = None,
) -> tuple[str, str]:
    """Do what the pressed button says; returns (message, notice kind) for the page."""
    who = (by or "").strip()
    if not who:
        return (
            "Type your name in “Your name” first (this browser remembers it), "
            "then press the button again.",
            "error",
        )
    try:
        if button == "tl-note-add":
            if not (text := (text or "").strip()):
                return "Write the note first: what you saw or did, in a line.", "error"
            note = client.add_note(run, author=who, text=text, incident=incident)
            where = f" (incident {note.incident})" if note.incident is not None else ""
            return f"Note {note.id} added to run {run}{where} as {who}.", "info"
        if incident is None:
            return "Pick an incident first.", "error"
        if button == "tl-retitle":
            if not (title := (title or "").strip()):
                return "Type the new title first.", "error"
            done = client.retitle_incident(incident, by=who, title=title)
            return f"Incident {done.id} is now titled “{done.title}”.", "info"
        if button == "tl-close":
            done = client.close_incident(incident, by=who, summary=(summary or "").strip() or None)
            return f"Incident {done.id} closed by {who}.", "info"
    except Refused as exc:
        return f"Not done: {exc}.", "error"
    return f"Nothing to do for {button}.", "error"


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks (component ids start with ``tl-``): a live refresh, redrawn
    only when something changed; the buttons."""
    hold_while_pointing(app, "tl-interval", "tl-tick")

    @app.callback(
        *[Output(part, "children") for part in PARTS],
        Output("tl-chart", "figure"),
        Output("tl-tools", "style"),
        Output("tl-close-tools", "style"),
        Output("tl-digest", "data"),
        Input("tl-tick", "data"),  # the interval's, held while a pointer is down on the chart
        Input("tl-url", "search"),
        Input("theme", "data"),
        Input("tl-changed", "data"),
        State("tl-run", "data"),
        State("tl-digest", "data"),
    )
    def refresh(
        _n: int | None,
        search: str | None,
        theme: str | None,
        _changed: int,
        name: str,
        seen: str | None,
    ) -> Any:
        try:
            parts = page_parts(client, name, search, theme, now=time.time())
        except NotFound:
            parts = _failed(
                f"Run {name!r} not found. A run appears once its first agent "
                "reports; check the name, or pick one from the runs list.",
                theme,
            )
        except Exception as exc:  # the page says so and retries; never a traceback
            log.exception("timeline page %s", name)
            parts = _failed(
                f"Cannot read the timeline from the collector's database: "
                f"{exc.__class__.__name__}. The page retries by itself.",
                theme,
            )
        drawn = digest(parts)  # the ages count on in the browser: not a change
        if drawn == seen:
            return (dash.no_update,) * (len(parts) + 1)
        return (*parts, drawn)

    @app.callback(
        Output("tl-feedback", "children"),
        Output("tl-changed", "data"),
        Output("tl-note-text", "value"),
        *[Input(b, "n_clicks") for b in BUTTONS],
        State("tl-author", "value"),
        State("tl-note-text", "value"),
        State("tl-retitle-title", "value"),
        State("tl-close-summary", "value"),
        State("tl-run", "data"),
        State("tl-url", "search"),
        State("tl-changed", "data"),
        prevent_initial_call=True,
    )
    def act(*args: Any) -> Any:
        by, text, title, summary, name, search, changed = args[len(BUTTONS) :]
        button = dash.ctx.triggered_id
        if button not in BUTTONS:
            return dash.no_update, dash.no_update, dash.no_update
        incident, _ = view.parse_query(search)
        try:
            message, kind = perform(
                client,
                button,
                run=name,
                incident=incident,
                by=by,
                text=text,
                title=title,
                summary=summary,
            )
        except Exception as exc:
            log.exception("timeline page: %s", button)
            message, kind = (
                (
                    f"Not done: the collector's database failed ({exc.__class__.__name__}). "
                    "Try again; if it stays, check the collector's log."
                ),
                "error",
            )
        cleared = "" if button == "tl-note-add" and kind == "info" else dash.no_update
        return notice(message, kind), (changed or 0) + 1, cleared


def _failed(message: str, theme: str | None) -> tuple[Any, ...]:
    return (
        notice(message, "error"),
        None,
        None,
        None,
        None,
        None,
        themed(empty_figure("No timeline"), theme),
        HIDDEN,
        HIDDEN,
    )
