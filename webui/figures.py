"""Figures as pure functions of query results (tests call them directly)."""

from __future__ import annotations

import plotly.graph_objects as go

from trainwarden.collector.schemas import Series

COLORS = {
    "loss": "#2563eb",
    "step_time": "#d97706",
    "data_wait": "#7c3aed",
    "tokens_per_s": "#059669",
}
_TEMPLATE = "plotly_white"


def _layout(fig: go.Figure, *, title: str, unit: str, revision: str) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}},
        template=_TEMPLATE,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        height=260,
        hovermode="x unified",
        legend={"orientation": "h", "y": 1.12, "x": 1, "xanchor": "right"},
        # Keeps the user's zoom and hidden traces across live refreshes.
        uirevision=revision,
    )
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text=unit or None)
    return fig


def empty_figure(message: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(
        template=_TEMPLATE,
        height=260,
        xaxis={"visible": False},
        yaxis={"visible": False},
        annotations=[
            {"text": message, "showarrow": False, "font": {"size": 14, "color": "#6b7280"}}
        ],
    )
    return fig


def band_figure(series: Series, *, title: str, revision: str) -> go.Figure:
    """Median across ranks as a line, min..max across ranks as a shaded band."""
    if not series.step:
        return empty_figure(f"No {title.lower()} yet: waiting for the first steps")
    color = COLORS.get(series.metric, "#374151")
    fig = go.Figure()
    fig.add_trace(
        go.Scatter(
            x=series.step,
            y=series.max,
            name="max",
            mode="lines",
            line={"width": 0, "color": color},
            showlegend=False,
            hoverinfo="skip",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=series.step,
            y=series.min,
            name="min..max across ranks",
            mode="lines",
            line={"width": 0, "color": color},
            fill="tonexty",
            fillcolor=_translucent(color),
            hoverinfo="skip",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=series.step,
            y=series.median,
            name="median",
            mode="lines",
            line={"width": 2, "color": color},
            customdata=list(zip(series.min, series.max, series.n, strict=False)),
            hovertemplate="median %{y:.4g}<br>min %{customdata[0]:.4g} · max %{customdata[1]:.4g}"
            "<br>%{customdata[2]} ranks<extra></extra>",
        )
    )
    return _layout(fig, title=title, unit=series.unit, revision=revision)


def total_figure(series: Series, *, title: str, revision: str) -> go.Figure:
    """The run-level value per step (e.g. tokens/s of the whole job)."""
    if not series.step:
        return empty_figure(f"No {title.lower()} yet: waiting for the first steps")
    color = COLORS.get(series.metric, "#374151")
    fig = go.Figure(
        go.Scatter(
            x=series.step,
            y=series.total,
            name=title,
            mode="lines",
            line={"width": 2, "color": color},
        )
    )
    return _layout(fig, title=title, unit=series.unit, revision=revision)


def _translucent(hex_color: str, alpha: float = 0.18) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"
