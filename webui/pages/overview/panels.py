"""The overview's header and ranks panel, as pure functions of the run, its GPU
readings and its events: the run's facts, each rank's state (culprits and victims say
so) with its GPU, and the latest health events."""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import quote

from dash import dcc, html

from trainwarden.collector.read.queries import RUN_STATUS_HELP

from ...components import ago
from ..hardware.panels import ACTION_TEXT, xid_rows

HEALTH_EVENTS = {"rank_state", "xid", "drill", "loss_divergence", "restart", "rank_conflict"}


def _event_text(e: Any) -> str:
    d = e.data or {}
    if e.kind == "rank_state":
        return f"{d.get('from')} → {d.get('to')}" + (f": {d['reason']}" if d.get("reason") else "")
    if e.kind == "xid":  # the catalog's words when the event has the code alone
        (x,) = xid_rows([e], [])
        code = "?" if x.code is None else x.code
        return f"XID {code} {x.name}: {x.meaning} Action: {ACTION_TEXT.get(x.action, x.action)}."
    if e.kind == "drill":
        return f"drill injected: {d.get('spec') or d.get('fault')}"
    if e.kind == "loss_divergence":
        return f"loss diverges from peers (robust z {d.get('robust_z')}): {d.get('reason', '')}"
    if e.kind == "rank_conflict":  # which processes collide: pid, node, session of each
        return f"duplicate rank: {d.get('reason', '')}"
    return e.kind


PANEL_RANKS = 32  # the overview lists every rank up to this; past it, those in trouble
QUIET = ("healthy", "running", "finished")


def ranks_panel(run: Any, gpu: list[Any], events: list[Any]) -> html.Div:
    """Rank states (culprits and victims say so), GPUs, and the latest health events."""
    latest: dict[int, Any] = {}
    for sample in gpu:
        latest[sample.rank] = sample
    rows = []
    listed = list(run.ranks)
    if len(listed) > PANEL_RANKS:  # a table of thousands of rows takes the browser minutes
        listed = [r for r in listed if r.state not in QUIET][:PANEL_RANKS]
    for r in listed:
        detail = r.state_detail or {}
        role = f"{detail['role']}: " if detail.get("role") else ""
        sample = latest.get(r.rank)
        if sample is not None:
            throttle = f" · {', '.join(sample.throttle)}" if sample.throttle else ""
            sim = " (simulated)" if sample.simulated else ""
            gpu_text = (
                f"{sample.temp_c:.0f} °C{throttle}{sim}"
                if sample.temp_c is not None
                else sample.gpu_name
            )
        elif r.gpu and r.gpu.get("state") == "unavailable":
            gpu_text = "no GPU telemetry"
        else:
            gpu_text = "—"
        rows.append(
            html.Tr(
                [
                    html.Td(r.rank),
                    html.Td(r.node or r.host),
                    html.Td(html.Span(r.state, className=f"status status-{r.state}")),
                    html.Td(role + detail.get("reason", ""), className="detail"),
                    html.Td("—" if r.last_step is None else r.last_step),
                    html.Td(gpu_text),
                ]
            )
        )
    table = html.Table(
        [
            html.Thead(
                html.Tr([html.Th(h) for h in ("Rank", "Node", "State", "Why", "Step", "GPU")])
            ),
            html.Tbody(rows),
        ],
        className="runs-table ranks-table",
    )
    recent = [e for e in events if e.kind in HEALTH_EVENTS][-8:]
    items = [
        html.Li(
            [
                html.Span(
                    dt.datetime.fromtimestamp(e.ts).strftime("%H:%M:%S"), className="fact-key"
                ),
                html.Span(f"rank {e.rank} " if e.rank is not None else ""),
                html.Span(_event_text(e), className=f"sev-{e.severity}"),
            ]
        )
        for e in reversed(recent)
    ]
    counts: dict[str, int] = {}
    for r in run.ranks:
        counts[r.state] = counts.get(r.state, 0) + 1
    summary = None
    if len(listed) < len(run.ranks):
        chips = [
            html.Span(f"{n} {state}", className=f"status status-{state}")
            for state, n in sorted(counts.items())
        ]
        link = dcc.Link(
            "every rank: the Ranks page", href=f"/runs/{quote(run.name, safe='')}/ranks"
        )
        summary = html.P(
            [
                *chips,
                f" — {len(listed)} of {len(run.ranks)} ranks listed (those in trouble); ",
                link,
            ],
            className="hint state-chips",
        )
    return html.Div(
        [summary, table if rows else None, html.Ul(items, className="events") if items else None],
        className="ranks-panel",
    )


def run_header(run: Any) -> Any:
    facts = [
        (
            "status",
            html.Span(
                run.status,
                className=f"status status-{run.status}",
                title=RUN_STATUS_HELP.get(run.status, ""),
            ),
        ),
        ("ranks", f"{run.ranks_seen} / {run.world_size}"),
        ("step", "—" if run.last_step is None else str(run.last_step)),
        ("updated", ago(run.updated_at)),
    ]
    return html.Div(
        [
            html.H2(run.name),
            html.Div(
                [
                    html.Span([html.Span(k, className="fact-key"), v], className="fact")  # type: ignore[list-item]
                    for k, v in facts
                ],
                className="facts",
            ),
        ]
    )
