"""What the timeline page shows, as pure functions of the API's answers (tests call them
directly): the incident list, the ordered entries, the derived figures and the download
links."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from typing import Any

from dash import dcc, html

from trainwarden.collector.incidents.report_format import duration
from trainwarden.collector.incidents.schemas import IncidentOut

from ...components import clock, live_ago, notice
from .query import downloads_href, page_href

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
