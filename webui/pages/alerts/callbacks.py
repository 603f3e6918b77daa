"""The alerts page's callbacks (component ids start with ``alerts-``): the filters and the
URL, the tables' live refresh, the buttons; each group registered by its own function."""

from __future__ import annotations

import logging
import time
from typing import Any

import dash
from dash import ALL, Input, Output, State

from ...client import Client
from ...components import notice, redraw
from .actions import SilenceForm, perform
from .data import page_parts
from .query import parse_query, query_string

log = logging.getLogger(__name__)


def _pressed() -> bool:
    """A button was clicked, not merely drawn anew by a refresh of its table."""
    return any(t.get("value") for t in dash.ctx.triggered)


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks: the filters and the URL follow each other; the tables
    refresh live, each only when something in it changed (a button is not redrawn under
    the pointer, typed inputs are never touched; the ages count on in the browser, see
    ``components.live_ago``); buttons act."""
    register_filters(app)
    register_tables(app, client)
    register_buttons(app, client)


def register_filters(app: dash.Dash) -> None:
    """The filters and the URL, each following the other."""

    @app.callback(
        Output("alerts-url", "search"),
        Output("alerts-run", "value"),
        Output("alerts-states", "value"),
        Input("alerts-url", "search"),
        Input("alerts-run", "value"),
        Input("alerts-states", "value"),
        prevent_initial_call=True,
    )
    def sync_url(search: str | None, run: str | None, states: list[str] | None) -> Any:
        """One callback both ways (Dash allows a cycle only within one): a filter
        changed writes the URL; a URL changed (back button, a link) sets the filters."""
        keep = dash.no_update
        if dash.ctx.triggered_id == "alerts-url":
            want_run, want_states = parse_query(search)
            if (want_run, sorted(want_states)) == (run, sorted(states or [])):
                return keep, keep, keep
            return keep, want_run, want_states
        wanted = query_string(run, states or [])
        return (keep if wanted == (search or "") else wanted), keep, keep


def register_tables(app: dash.Dash, client: Client) -> None:
    """The alerts, silences and actions, refreshed live; each redrawn only on a change."""

    @app.callback(
        Output("alerts-table", "children"),
        Output("alerts-silences", "children"),
        Output("alerts-actions", "children"),
        Output("alerts-digest", "data"),
        Input("alerts-interval", "n_intervals"),
        Input("alerts-run", "value"),
        Input("alerts-states", "value"),
        Input("alerts-changed", "data"),
        State("alerts-digest", "data"),
    )
    def refresh(
        _n: int | None,
        run: str | None,
        states: list[str] | None,
        _changed: int,
        seen: list[str] | None,
    ) -> Any:
        try:
            parts = page_parts(client, run=run, states=list(states or []), now=time.time())
        except Exception as exc:
            log.exception("alerts page")
            parts = (
                notice(
                    f"Cannot read alerts from the collector's database: {exc.__class__.__name__}. "
                    "The page retries by itself; if this stays, check the collector's log "
                    "and its database.",
                    "error",
                ),
                None,
                None,
            )
        shown, digests = redraw(parts, seen)
        return (*shown, digests)


def register_buttons(app: dash.Dash, client: Client) -> None:
    """The buttons: acknowledge, silence, end a silence, approve or cancel an action;
    “Silence…” on an alert fills the form in."""

    @app.callback(
        Output("alerts-feedback", "children"),
        Output("alerts-changed", "data"),
        Input({"type": "alerts-ack", "index": ALL}, "n_clicks"),
        Input({"type": "alerts-unsilence", "index": ALL}, "n_clicks"),
        Input({"type": "alerts-approve", "index": ALL}, "n_clicks"),
        Input({"type": "alerts-cancel", "index": ALL}, "n_clicks"),
        Input("alerts-silence-submit", "n_clicks"),
        State("alerts-by", "value"),
        State("alerts-silence-run", "value"),
        State("alerts-silence-rank", "value"),
        State("alerts-silence-alertname", "value"),
        State("alerts-silence-duration", "value"),
        State("alerts-silence-comment", "value"),
        State("alerts-changed", "data"),
        prevent_initial_call=True,
    )
    def act(*args: Any) -> Any:
        by, run, rank, alertname, duration_s, comment, changed = args[5:]
        if not _pressed() or dash.ctx.triggered_id is None:
            return dash.no_update, dash.no_update
        form = SilenceForm(run, rank, alertname, duration_s, comment)
        try:
            message, kind = perform(client, dash.ctx.triggered_id, by=by, form=form)
        except Exception as exc:
            log.exception("alerts page: %s", dash.ctx.triggered_id)
            message, kind = (
                (
                    f"Not done: the collector's database failed ({exc.__class__.__name__}). "
                    "Try again; if it stays, check the collector's log."
                ),
                "error",
            )
        return notice(message, kind), (changed or 0) + 1

    @app.callback(
        Output("alerts-silence-run", "value"),
        Output("alerts-silence-rank", "value"),
        Output("alerts-silence-alertname", "value"),
        Input({"type": "alerts-mute", "index": ALL}, "n_clicks"),
        prevent_initial_call=True,
    )
    def silence_like(_clicks: list[int | None]) -> Any:
        """“Silence…” on an alert: the form names its run, rank and rule."""
        trigger = dash.ctx.triggered_id
        if not _pressed() or trigger is None:
            return (dash.no_update,) * 3
        try:
            alert = client.alert(int(trigger["index"]))
        except Exception:
            log.exception("alerts page: silence like %s", trigger)
            return (dash.no_update,) * 3
        return alert.run, "" if alert.rank is None else str(alert.rank), alert.rule
