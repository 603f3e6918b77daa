"""The timeline page's chart, as a pure function of the timeline's entries: a lane per
source, a marker per entry coloured by severity, an incident's key moments as lines."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from ...charts import empty_figure, themed
from .panels import SEVERITIES

# Lanes of the chart, top to bottom: cause, then response, then what people wrote.
LANES = ("attempt", "event", "derived", "alert", "page", "action", "incident", "note")
MOMENTS = (("fault_at", "fault"), ("pending_at", "alert"), ("recovered_at", "recovered"))
COLORS = {"info": "#2563eb", "warning": "#d97706", "critical": "#dc2626"}


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
