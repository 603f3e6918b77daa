"""What the alerts page shows, as pure functions of the API's objects (tests call them
directly): alert rows with their runbook links, silences, actions, and the run page's
short list of open alerts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

from dash import dcc, html

from trainwarden.collector.actions.records import summary
from trainwarden.collector.actions.schemas import ActionOut
from trainwarden.collector.alerting.schemas import AlertOut, Matcher, SilenceOut
from trainwarden.collector.read.runbooks import runbook_url

from ...components import clock, live_ago, live_until, notice
from .query import OPEN, STATES, query_string

DECIDABLE = {"proposed": ("approve", "cancel"), "approved": ("cancel",)}
ALERTS_SHOWN = 200


# -- pieces ----------------------------------------------------------------------


def runbook_href(alert: AlertOut) -> str:
    """The alert's ``runbook_url`` when it is a link (absolute, or on this server);
    otherwise where this server serves the runbook of the alert's rule."""
    url = (alert.runbook_url or "").strip()
    if url.startswith(("http://", "https://", "/")):
        return url
    return runbook_url(None, url or alert.rule)


def where(alert: AlertOut) -> str:
    parts = [
        f"rank {alert.rank}" if alert.rank is not None else "",
        alert.node or "",
        f"GPU {alert.gpu}" if alert.gpu else "",
    ]
    return " · ".join(p for p in parts if p) or "whole run"


def since(alert: AlertOut, now: float) -> list[Any]:
    """When the alert entered its current state."""
    if alert.state == "resolved" and alert.resolved_at is not None:
        return [f"at {clock(alert.resolved_at, now)} (", live_ago(alert.resolved_at, now), ")"]
    ts = alert.fired_at if alert.state == "firing" and alert.fired_at else alert.active_since
    return [f"since {clock(ts, now)} (", live_ago(ts, now), ")" + onset(alert)]


def onset(alert: AlertOut) -> str:
    """Where the anomaly began in the data, when a pass saw it later (fast steps)."""
    if alert.onset_step is None or alert.onset_step == alert.fired_at_step:
        return ""
    return f"; began at step {alert.onset_step}"


def marks(alert: AlertOut, now: float) -> list[html.Span]:
    """Why nobody is paged for it, and who is on it."""
    out = []
    if alert.silenced_by is not None:
        out.append(html.Span(f"silenced (#{alert.silenced_by})", className="mark mark-silenced"))
    if alert.inhibited_by is not None:
        text = f"inhibited by alert #{alert.inhibited_by}"
        out.append(html.Span(text, className="mark mark-inhibited"))
    if alert.acked_by:
        acked: list[Any] = [f"acked by {alert.acked_by}"]
        if alert.acked_at:
            acked += [" ", live_ago(alert.acked_at, now)]
        out.append(html.Span(acked, className="mark mark-acked", title=alert.ack_comment or ""))
    return out


def matchers_text(matchers: Sequence[Matcher]) -> str:
    return ", ".join(f"{mt.name}{'=~' if mt.regex else '='}{mt.value}" for mt in matchers)


def _severity(severity: str) -> html.Span:
    return html.Span(severity, className=f"severity severity-{severity}")


def _status(state: str) -> html.Span:
    return html.Span(state, className=f"status status-{state}")


def _runbook(alert: AlertOut) -> html.A:
    # A new tab: the on-call engineer keeps the alert list while reading what to do.
    return html.A(
        "Runbook",
        href=runbook_href(alert),
        className="runbook-link",
        target="_blank",
        rel="noopener",
    )


def _run_link(run: str) -> dcc.Link:
    return dcc.Link(run, href=f"/runs/{quote(run, safe='')}", className="run-link")


def _two_lines(first: Any, second: Any, first_class: str = "") -> list[Any]:
    top = html.Div(first, className=first_class) if first_class else first
    return [top, html.Div(second, className="detail")]


def _button(label: str, kind: str, index: int, primary: bool = False) -> html.Button:
    style = "btn btn-small btn-primary" if primary else "btn btn-small"
    return html.Button(label, id={"type": kind, "index": index}, className=style, n_clicks=0)


def _table(head: Sequence[str], rows: list[html.Tr], name: str) -> html.Table:
    return html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in head])), html.Tbody(rows)],
        className=f"runs-table {name}",
    )


# -- alerts ----------------------------------------------------------------------


def alert_row(alert: AlertOut, *, now: float) -> html.Tr:
    description = alert.annotations.get("description") or alert.annotations.get("summary") or ""
    buttons = []
    if alert.state != "resolved":
        if not alert.acked_by:
            buttons.append(_button("Acknowledge", "alerts-ack", alert.id, primary=True))
        buttons.append(_button("Silence…", "alerts-mute", alert.id))
    quiet = alert.silenced_by is not None or alert.inhibited_by is not None
    return html.Tr(
        [
            html.Td(_severity(alert.severity)),
            html.Td(_two_lines(alert.rule, description, "alert-rule")),
            html.Td(_run_link(alert.run)),
            html.Td(where(alert), className="detail"),
            html.Td(_two_lines(_status(alert.state), since(alert, now))),
            html.Td(_runbook(alert)),
            html.Td(marks(alert, now), className="marks"),
            html.Td(buttons, className="buttons"),
        ],
        id=f"alert-{alert.id}",
        className=f"alert-row alert-{alert.state}" + (" alert-quiet" if quiet else ""),
    )


def empty_text(run: str | None, states: Sequence[str]) -> str:
    chosen = set(states)
    if chosen == {"firing"}:
        what = "No alerts firing"
    elif chosen == set(OPEN):
        what = "No alerts firing or pending"
    else:
        what = "No " + " or ".join(s for s in STATES if s in chosen) + " alerts"
    if run:
        return f"{what} for run {run}. Clear the run filter to see every run."
    if "resolved" not in chosen:
        return f"{what}. Rules are evaluated every few seconds; tick “resolved” for past alerts."
    return f"{what}."


def alerts_table(
    alerts: Sequence[AlertOut], *, now: float, run: str | None, states: Sequence[str]
) -> Any:
    if not states:
        return notice("Tick at least one state above (pending, firing, resolved) to list alerts.")
    if not alerts:
        return notice(empty_text(run, states))
    head = ("Severity", "Alert", "Run", "Where", "State", "", "", "")
    table = _table(head, [alert_row(a, now=now) for a in alerts], "alerts-table")
    if len(alerts) < ALERTS_SHOWN:
        return table
    more = f"The newest {ALERTS_SHOWN}; filter by run or state for the rest."
    return [table, html.P(more, className="hint")]


def run_alerts_panel(alerts: Sequence[AlertOut], *, run: str, now: float) -> html.Div:
    """The run page's short list of its open alerts, with their runbooks."""
    history = dcc.Link("all alerts of this run", href=f"/alerts{query_string(run, STATES)}")
    if not alerts:
        return html.Div(
            [html.Span("No open alerts · ", className="detail"), history],
            className="run-alerts run-alerts-none",
        )
    items = [
        html.Li(
            [
                _severity(a.severity),
                html.Span(a.rule, className="alert-rule"),
                html.Span(where(a), className="detail"),
                _status(a.state),
                html.Span(since(a, now), className="detail"),
                _runbook(a),
            ],
            className=f"alert-item alert-{a.state}",
        )
        for a in alerts
    ]
    title = html.Div([html.Strong(f"Open alerts ({len(alerts)})"), " · ", history])
    return html.Div([title, html.Ul(items, className="alert-list")], className="run-alerts")


# -- silences and actions --------------------------------------------------------


def silences_table(silences: Sequence[SilenceOut], *, now: float) -> Any:
    if not silences:
        return notice("No active silences.")
    rows = [
        html.Tr(
            [
                html.Td(matchers_text(s.matchers), className="matchers"),
                html.Td(
                    [
                        ("until " if s.active else f"from {clock(s.starts_at, now)} until ")
                        + f"{clock(s.ends_at, now)} (",
                        live_until(s.ends_at, now),
                        ")",
                    ]
                ),
                html.Td(s.created_by),
                html.Td(s.comment, className="detail"),
                html.Td(_button("End", "alerts-unsilence", s.id), className="buttons"),
            ],
            id=f"silence-{s.id}",
            className="silence-row",
        )
        for s in silences
    ]
    return _table(("Matches", "Active", "By", "Why", ""), rows, "silences-table")


def _compact(value: Any, limit: int = 160) -> str:
    if isinstance(value, dict):
        text = ", ".join(
            f"{k} {_compact(v)}" for k, v in value.items() if v not in (None, [], {}, "")
        )
    elif isinstance(value, list):
        text = ", ".join(_compact(v) for v in value)
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def action_summary(action: ActionOut) -> str:
    """Why it failed or was cancelled, else what it did (or, dry-run, would do)."""
    return _compact(summary(action.kind, action.state, action.result, action.reason))


def action_row(action: ActionOut, *, now: float) -> html.Tr:
    target = action.node or (f"rank {action.rank}" if action.rank is not None else "")
    verbs = DECIDABLE.get(action.state, ())
    buttons = [_button(v.capitalize(), f"alerts-{v}", action.id, v == "approve") for v in verbs]
    state = [f"{action.mode} · ", live_ago(action.updated_at, now)]
    return html.Tr(
        [
            html.Td(_two_lines(action.kind, target, "alert-rule")),
            html.Td(_run_link(action.run)),
            html.Td(_two_lines(_status(action.state), state)),
            html.Td(action.trigger),
            html.Td(action.approver or "—"),
            html.Td(action_summary(action), className="detail"),
            html.Td(buttons, className="buttons"),
        ],
        id=f"action-{action.id}",
        className="action-row",
    )


def actions_table(actions: Sequence[ActionOut], *, now: float, run: str | None = None) -> Any:
    if not actions:
        return notice(
            f"No actions {f'for run {run}' if run else 'yet'}. Rules with an action (LossSpike, "
            "FatalXid, …) and operators (POST /api/v1/runs/<run>/actions) start them; "
            "see docs/actions.md."
        )
    head = ("Action", "Run", "State", "Trigger", "Approver", "Result", "")
    return _table(head, [action_row(a, now=now) for a in actions], "actions-table")
