"""The alerts page, ``/alerts``: the layout and its callbacks. What it draws comes from
:mod:`.alerts`; what its buttons do goes through the client to the API's own route
functions, so no business rule is written twice.

With auth on, the buttons act only for a session whose token has the ``admin`` scope; a
``read`` session is told it needs one, and nothing changes (docs/security.md). The name
field records who did it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dash
from dash import ALL, Input, Output, State, dcc, html

from ...client import Client, Refused
from ...components import clock, notice, redraw
from . import panels as view

log = logging.getLogger(__name__)
DURATIONS = [
    ("30 min", 1800),
    ("1 hour", 3600),
    ("4 hours", 14_400),
    ("12 hours", 43_200),
    ("1 day", 86_400),
    ("3 days", 259_200),
    ("7 days", 604_800),
]
ACTIONS_SHOWN = 50
NEEDS_NAME = {"alerts-ack", "alerts-approve", "alerts-cancel", "alerts-silence-submit"}


@dataclass
class SilenceForm:
    """The silence form as typed; :meth:`matchers` says what is missing."""

    run: str | None = None
    rank: str | None = None
    alertname: str | None = None
    duration_s: float | None = 3600
    comment: str | None = None

    def matchers(self) -> list[dict[str, Any]]:
        given = (("run", self.run), ("rank", self.rank), ("alertname", self.alertname))
        out = [
            {"name": name, "value": value.strip()}
            for name, value in given
            if value and value.strip()
        ]
        if not out:
            raise Refused(
                "fill in at least one of run, rank and alert name: a silence names what it silences"
            )
        if self.rank and self.rank.strip() and not self.rank.strip().isdigit():
            raise Refused(f"rank {self.rank.strip()!r} is not a rank number; give one like 3")
        if not (self.comment or "").strip():
            raise Refused("say why in “Why”: whoever is paged next reads it")
        return out


def perform(client: Client, trigger: Any, *, by: str | None, form: SilenceForm) -> tuple[str, str]:
    """Do what the pressed button says; returns (message, notice kind) for the page."""
    kind = trigger if isinstance(trigger, str) else trigger["type"]
    index = 0 if isinstance(trigger, str) else int(trigger["index"])
    who = (by or "").strip()
    if kind in NEEDS_NAME and not who:
        return (
            "Type your name in “Your name” at the top first (this browser remembers it), "
            "then press the button again.",
            "error",
        )
    try:
        if kind == "alerts-ack":
            alert = client.ack(index, by=who)
            if alert.acked_by != who:
                return (
                    f"{alert.rule} (#{alert.id}) was already acknowledged by {alert.acked_by}.",
                    "info",
                )
            return (
                f"Acknowledged {alert.rule} (#{alert.id}) as {who}: it is no longer re-sent.",
                "info",
            )
        if kind in ("alerts-approve", "alerts-cancel"):
            action = client.decide(index, approve=kind == "alerts-approve", by=who)
            return (
                f"The {action.kind} #{action.id} of run {action.run} is now {action.state}.",
                "info",
            )
        if kind == "alerts-unsilence":
            ended = client.end_silence(index)
            return f"Silence #{ended.id} ({view.matchers_text(ended.matchers)}) ended.", "info"
        if kind == "alerts-silence-submit":
            made = client.silence(
                matchers=form.matchers(),
                duration_s=form.duration_s or 3600,
                by=who,
                comment=(form.comment or "").strip(),
            )
            return (
                f"Silenced {view.matchers_text(made.matchers)} until {clock(made.ends_at)} "
                f"(#{made.id}): matching alerts are listed, nobody is paged.",
                "info",
            )
    except Refused as exc:
        return f"Not done: {exc}.", "error"
    return f"Nothing to do for {kind}.", "error"


def _field(label: str, control: Any, *, wide: bool = False) -> html.Label:
    return html.Label(
        [html.Span(label, className="field-label"), control],
        className="field field-wide" if wide else "field",
    )


def layout(search: str | None, *, runs: Sequence[str], refresh_s: float) -> html.Div:
    run, states = view.parse_query(search)
    options = sorted({*runs, *([run] if run else [])})
    filters = [
        _field(
            "Run",
            dcc.Dropdown(
                id="alerts-run", options=options, value=run, placeholder="All runs", clearable=True
            ),
            wide=True,
        ),
        _field(
            "State",
            dcc.Checklist(
                id="alerts-states",
                options=list(view.STATES),
                value=states,
                inline=True,
                className="checks",
            ),
        ),
        _field(
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
        _field("Run", dcc.Input(id="alerts-silence-run", placeholder="run name", value=run or "")),
        _field("Rank", dcc.Input(id="alerts-silence-rank", placeholder="any", inputMode="numeric")),
        _field("Alert name", dcc.Input(id="alerts-silence-alertname", placeholder="e.g. FatalXid")),
        _field(
            "For",
            dcc.Dropdown(
                id="alerts-silence-duration",
                value=3600,
                clearable=False,
                searchable=False,
                options=[{"label": k, "value": v} for k, v in DURATIONS],
            ),
        ),
        _field(
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


def page_parts(
    client: Client, *, run: str | None, states: list[str], now: float
) -> tuple[Any, ...]:
    found = client.alerts(run=run, states=states, limit=view.ALERTS_SHOWN) if states else []
    return (
        view.alerts_table(found, now=now, run=run, states=states),
        view.silences_table(client.silences(), now=now),
        view.actions_table(client.actions(run=run, limit=ACTIONS_SHOWN), now=now, run=run),
    )


def _pressed() -> bool:
    """A button was clicked, not merely drawn anew by a refresh of its table."""
    return any(t.get("value") for t in dash.ctx.triggered)


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks: the filters and the URL follow each other; the tables
    refresh live, each only when something in it changed (a button is not redrawn under
    the pointer, typed inputs are never touched; the ages count on in the browser, see
    ``components.live_ago``); buttons act."""

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
            want_run, want_states = view.parse_query(search)
            if (want_run, sorted(want_states)) == (run, sorted(states or [])):
                return keep, keep, keep
            return keep, want_run, want_states
        wanted = view.query_string(run, states or [])
        return (keep if wanted == (search or "") else wanted), keep, keep

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
