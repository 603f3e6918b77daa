"""The timeline page's callbacks (component ids start with ``tl-``), each group
registered by its own function."""

from __future__ import annotations

import logging
import time
from typing import Any

import dash
from dash import Input, Output, State

from trainwarden.collector.read.queries import NotFound

from ...client import Client
from ...components import digest, notice
from ...gestures import hold_while_pointing
from .actions import BUTTONS, perform
from .data import PARTS, failed, page_parts
from .query import parse_query

log = logging.getLogger(__name__)


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks (component ids start with ``tl-``): a live refresh, redrawn
    only when something changed; the buttons."""
    register_refresh(app, client)
    register_buttons(app, client)


def register_refresh(app: dash.Dash, client: Client) -> None:
    """The live refresh (its ticks held while a pointer is down on the chart), redrawn
    only when something changed."""
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
            parts = failed(
                f"Run {name!r} not found. A run appears once its first agent "
                "reports; check the name, or pick one from the runs list.",
                theme,
            )
        except Exception as exc:  # the page says so and retries; never a traceback
            log.exception("timeline page %s", name)
            parts = failed(
                f"Cannot read the timeline from the collector's database: "
                f"{exc.__class__.__name__}. The page retries by itself.",
                theme,
            )
        drawn = digest(parts)  # the ages count on in the browser: not a change
        if drawn == seen:
            return (dash.no_update,) * (len(parts) + 1)
        return (*parts, drawn)


def register_buttons(app: dash.Dash, client: Client) -> None:
    """Add a note, retitle, close: the feedback, and a refresh of the page."""

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
        incident, _ = parse_query(search)
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
