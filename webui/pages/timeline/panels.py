"""What the timeline page shows, as pure functions of the API's answers (tests call them
directly): the incident list, the ordered entries, the derived figures, the download
links, a chart of the entries by source, and the page's URL (``?incident=3``)."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, quote

import plotly.graph_objects as go
from dash import dcc, html

from trainwarden.collector.incidents.report_format import duration
from trainwarden.collector.incidents.schemas import IncidentOut

from ...charts import empty_figure, themed
from ...components import clock, live_ago, notice

SEVERITIES = ("info", "warning", "critical")
ENTRIES_SHOWN = 1000  # a long run's whole timeline: the newest entries
MISSING = "—"
FIGURES = (
    ("detect_s", "Time to detect"),
    ("page_s", "Time to page"),
    ("act_s", "Time to act"),
    ("recover_s", "Time to recover"),
    ("steps_lost", "Steps lost"),
    ("time_lost_s", "Time lost"),
    ("gpu_hours_lost", "GPU-hours lost"),
    ("cost", "Cost"),
)
# Lanes of the chart, top to bottom: cause, then response, then what people wrote.
LANES = ("attempt", "event", "derived", "alert", "page", "action", "incident", "note")
MOMENTS = (("fault_at", "fault"), ("pending_at", "alert"), ("recovered_at", "recovered"))
COLORS = {"info": "#2563eb", "warning": "#d97706", "critical": "#dc2626"}


# -- the URL ---------------------------------------------------------------------


def parse_query(search: str | None) -> tuple[int | None, str | None]:
    """``?incident=3`` → (3, None); a value that is not an incident number → (None, what
    is wrong), so a hand-edited URL still shows the whole run's timeline."""
    values = parse_qs((search or "").lstrip("?")).get("incident") or [""]
    text = values[0].strip()
    if not text:
        return None, None
    if text.isdigit() and 1 <= int(text) <= 2**63 - 1:
        return int(text), None
    return None, f"“{text}” is not an incident number (?incident=3); showing the whole run."


def query_string(incident: int | None) -> str:
    return f"?incident={incident}" if incident is not None else ""


def page_href(run: str, incident: int | None = None) -> str:
    return f"/runs/{quote(run, safe='')}/timeline{query_string(incident)}"


def downloads_href(run: str, fmt: str, incident: int | None = None) -> str:
    """The post-mortem report as a file, served by the collector's API."""
    extra = f"&incident={incident}" if incident is not None else ""
    return f"/api/v1/runs/{quote(run, safe='')}/postmortem?format={fmt}{extra}&download=true"


# -- pieces ----------------------------------------------------------------------


def stamp(ts: float, now: float) -> str:
    """Local time to a tenth of a second (entries a few hundred ms apart stay apart);
    with the date when it is not today."""
    when = dt.datetime.fromtimestamp(ts)
    text = when.strftime("%H:%M:%S.") + f"{when.microsecond // 100_000}"
    if when.date() != dt.datetime.fromtimestamp(now).date():
        text = when.strftime("%Y-%m-%d ") + text
    return text


def offset(ts: float, origin: float | None) -> str:
    """``+0.8 s`` from the incident's fault (or first alert); ``-1.2 s`` before it."""
    if origin is None:
        return ""
    seconds = ts - origin
    return ("+" if seconds >= 0 else "") + duration(seconds)


def where(entry: dict[str, Any]) -> str:
    parts = [
        f"rank {entry['rank']}" if entry.get("rank") is not None else "",
        entry.get("node") or "",
    ]
    return " · ".join(p for p in parts if p) or MISSING


def severity_badge(severity: str | None) -> html.Span:
    """The severity as the alerts page shows it; one it does not know looks like info."""
    sev = severity or "info"
    known = sev if sev in SEVERITIES else "info"
    return html.Span(sev, className=f"severity severity-{known}")


def links(entry: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    if entry.get("runbook_url"):
        out.append(
            html.A("runbook", href=entry["runbook_url"], className="runbook-link", target="_blank")
        )
    if entry.get("ui_url"):
        out.append(html.A("view", href=entry["ui_url"], className="tl-ui-link"))
    return out


def entries_table(
    entries: Sequence[dict[str, Any]],
    *,
    now: float,
    origin: float | None = None,
    limit: int = ENTRIES_SHOWN,
) -> Any:
    """The entries in the order given (the collector orders them: time, then cause before
    effect); ``origin``: a T+ column from that moment. Past ``limit``, the newest."""
    if not entries:
        return notice("Nothing happened here yet: no alerts, actions, events or notes.")
    shown = list(entries)[-limit:]
    header = [
        "Time",
        *(["T+"] if origin is not None else []),
        "Step",
        "Source",
        "Rank / node",
        "Severity",
        "What",
        "Links",
    ]
    rows = []
    for e in shown:
        sev = e.get("severity") or "info"
        cells = [html.Td(stamp(e["at"], now), className="tl-time")]
        if origin is not None:
            cells.append(html.Td(offset(e["at"], origin), className="tl-offset"))
        cells += [
            html.Td(MISSING if e.get("step") is None else e["step"]),
            html.Td(f"{e['source']} · {e['kind']}", className="tl-source"),
            html.Td(where(e)),
            html.Td(severity_badge(sev)),
            html.Td(e["text"], className="tl-text"),
            html.Td(links(e), className="tl-links"),
        ]
        known = sev if sev in SEVERITIES else "info"
        rows.append(html.Tr(cells, className=f"tl-entry tl-{e['source']} tl-sev-{known}"))
    table = html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in header])), html.Tbody(rows)],
        className="runs-table tl-table",
    )
    if len(shown) < len(entries):
        left = len(entries) - len(shown)
        return html.Div(
            [
                notice(
                    f"Showing the newest {len(shown)} of {len(entries)} entries "
                    f"({left} older ones left out)."
                ),
                table,
            ]
        )
    return table


def figure_value(key: str, figures: dict[str, Any]) -> str:
    """One derived figure as people read it; a moment that is missing (nobody was paged,
    no action was taken) is ``—``, and cost needs a price per GPU-hour."""
    value = figures.get(key)
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return MISSING
    if key.endswith("_s"):
        return duration(value)
    if key == "steps_lost":
        return str(value)
    if key == "gpu_hours_lost":
        return f"{value:.3f} ({figures.get('world_size', '?')} GPUs)"
    if key == "cost":
        return f"{value:.2f} at {figures['price_per_gpu_hour']:g} per GPU-hour"
    return str(value)


def figures_card(figures: dict[str, Any] | None, definitions: dict[str, str]) -> Any:
    """The incident's time to detect, page, act and recover, and what it cost."""
    if figures is None:
        return notice(
            "Pick an incident for its figures: time to detect, page, act and "
            "recover; steps, GPU-hours and cost lost."
        )
    items = []
    for key, label in FIGURES:
        hint = definitions.get(key, "")
        if key == "cost" and figures.get("price_per_gpu_hour") is None:
            hint = (
                "no price per GPU-hour: start serve with --price-per-gpu-hour "
                "(TRAINWARDEN_PRICE_PER_GPU_HOUR)"
            )
        items.append(
            html.Div(
                [
                    html.Span(label, className="fact-key"),
                    html.Span(figure_value(key, figures), className="tl-fig-value"),
                ],
                id=f"tl-fig-{key}",
                className="tl-fig",
                title=hint,
            )
        )
    fault = figures.get("fault")
    cause = html.P(
        f"Fault: {fault}"
        if fault
        else "Fault: not found (no fault event or flagged step before the first alert).",
        className="hint",
    )
    return html.Div([html.Div(items, className="tl-figures"), cause], className="tl-card")


def incident_label(i: IncidentOut) -> str:
    return f"#{i.id} {i.title}"


def incidents_list(
    incidents: Sequence[IncidentOut], *, run: str, selected: int | None, now: float
) -> Any:
    """The run's incidents as links (newest first), and the whole run's timeline."""
    whole = dcc.Link(
        "Whole run",
        href=page_href(run),
        id="tl-inc-all",
        className="tl-inc tl-inc-selected" if selected is None else "tl-inc",
    )
    if not incidents:
        return html.Div(
            [
                notice(
                    "No incidents: nothing has gone wrong that an alert grouped, "
                    "and nobody opened one. The whole run's timeline is below."
                ),
                whole,
            ],
            className="tl-incidents",
        )
    items = [whole]
    for i in sorted(incidents, key=lambda x: x.opened_at, reverse=True):
        cls = "tl-inc tl-inc-selected" if i.id == selected else "tl-inc"
        items.append(
            dcc.Link(
                [
                    html.Span(incident_label(i), className="tl-inc-title"),
                    html.Span(i.state, className=f"status status-{i.state}"),
                    severity_badge(i.severity),
                    html.Span(["opened ", live_ago(i.opened_at, now)], className="hint"),
                ],
                href=page_href(run, i.id),
                id=f"tl-inc-{i.id}",
                className=cls,
            )
        )
    return html.Div(items, className="tl-incidents")


def incident_header(i: IncidentOut | None, *, now: float) -> Any:
    if i is None:
        return None
    bits = [f"{i.state}", f"opened {clock(i.opened_at, now)} by {i.opened_by}"]
    if i.closed_at is not None:
        bits.append(f"closed {clock(i.closed_at, now)} by {i.closed_by}")
    if i.ranks:
        bits.append("ranks " + ", ".join(map(str, i.ranks)))
    if i.nodes:
        bits.append(", ".join(i.nodes))
    return html.Div(
        [
            html.H3(f"Incident {incident_label(i)}"),
            html.P(" · ".join(bits), className="hint"),
            html.P(i.summary, className="tl-summary") if i.summary else None,
        ]
    )


def downloads(run: str, incident: int | None) -> html.Div:
    what = f"incident {incident}" if incident is not None else "every incident of the run"
    return html.Div(
        [
            html.Span(f"Post-mortem of {what}:", className="fact-key"),
            *[
                html.A(
                    label,
                    href=downloads_href(run, fmt, incident),
                    className="btn btn-small tl-download",
                    id=f"tl-download-{fmt}",
                )
                for fmt, label in (("md", "Markdown"), ("html", "HTML"), ("json", "JSON"))
            ],
        ],
        className="tl-downloads",
    )


# -- the chart ---------------------------------------------------------------------


def timeline_figure(
    entries: Sequence[dict[str, Any]],
    figures: dict[str, Any] | None,
    *,
    theme: str | None,
    revision: str,
) -> go.Figure:
    """Entries as markers on lanes by source (coloured by severity); an incident's key
    moments (fault, first alert, recovery) as vertical lines."""
    if not entries:
        return themed(empty_figure("No entries yet."), theme)
    fig = go.Figure()
    lanes = [lane for lane in LANES if any(e["source"] == lane for e in entries)]
    lanes += sorted({e["source"] for e in entries} - set(lanes))
    for sev in SEVERITIES:
        mine = [
            e
            for e in entries
            if (e.get("severity") if e.get("severity") in SEVERITIES else "info") == sev
        ]
        if not mine:
            continue
        fig.add_trace(
            go.Scatter(
                x=[dt.datetime.fromtimestamp(e["at"]) for e in mine],
                y=[e["source"] for e in mine],
                mode="markers",
                name=sev,
                text=[e["text"] for e in mine],
                marker={
                    "color": COLORS[sev],
                    "size": 10,
                    "symbol": "diamond" if sev == "critical" else "circle",
                },
                hovertemplate="%{x|%H:%M:%S.%L}<br>%{text}<extra>%{y}</extra>",
            )
        )
    for key, label in MOMENTS:
        at = (figures or {}).get(key)
        if at is not None:  # local time, as the markers (add_vline mishandles dates)
            x = dt.datetime.fromtimestamp(at)
            fig.add_shape(
                type="line",
                x0=x,
                x1=x,
                y0=0,
                y1=1,
                yref="paper",
                line={"dash": "dot", "color": "#6b7280", "width": 1},
            )
            fig.add_annotation(
                x=x,
                y=1,
                yref="paper",
                yanchor="bottom",
                text=label,
                showarrow=False,
                font={"size": 11, "color": "#6b7280"},
            )
    fig.update_layout(
        height=120 + 28 * len(lanes),
        margin={"l": 80, "r": 20, "t": 30, "b": 30},
        uirevision=revision,
        hovermode="closest",
        legend={"orientation": "h", "y": 1.15, "x": 1, "xanchor": "right"},
    )
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)), title_text=None)
    fig.update_xaxes(type="date")
    return themed(fig, theme)
