"""Chart helpers the pages share: the metrics' colours, the themes (Plotly templates on a
transparent card, for figures and for layout dicts), the empty figure and a layout's
placeholder; and figures of one series as pure functions of query results (tests call
them directly)."""

from __future__ import annotations

import functools
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from trainwarden.agent import metric_catalog as catalog
from trainwarden.collector.read.schemas import Series

COLORS = {m.name: m.color for m in catalog.METRICS if m.color}


def layer(metric: str, key: str | None = None, label: str | None = None) -> tuple[str, str, str]:
    """A stacked layer of ``metric``: (its key in the figure, its label, its colour)."""
    found = catalog.METRIC[metric]
    return key or metric, label or found.label.lower(), found.color or "#374151"


# The step-time breakdown, bottom to top. With a comm split: compute that nothing
# overlaps, compute with communication hidden under it, exposed communication, idle,
# and the data wait before the step. Without one: the phases.
BREAKDOWN_COMM = [
    layer("compute", "compute_only"),
    layer("overlapped_comm"),
    layer("exposed_comm"),
    layer("idle"),
    layer("data_wait"),
]
BREAKDOWN_PHASES = [
    layer("forward"),
    layer("backward"),
    layer("optimizer"),
    layer("other"),
    layer("data_wait"),
]
_TEMPLATE = "plotly_white"
TEMPLATES = {"light": "plotly_white", "dark": "plotly_dark"}


def template(theme: str | None) -> str:
    """The Plotly template of the UI's theme ("light" or "dark")."""
    return TEMPLATES.get(theme or "light", _TEMPLATE)


def themed(fig: go.Figure, theme: str | None) -> go.Figure:
    """``fig`` in the theme's template, on a transparent background (the card shows)."""
    fig.update_layout(
        template=template(theme),
        paper_bgcolor="rgba(0,0,0,0)",
        plot_bgcolor="rgba(0,0,0,0)" if theme == "dark" else None,
    )
    return fig


@functools.cache
def _template_json(name: str) -> dict[str, Any]:
    """A Plotly template as JSON (Plotly.js knows no template names). Shared: read only."""
    return go.layout.Template(pio.templates[name]).to_plotly_json()  # type: ignore[no-any-return]


def prepare_templates() -> None:
    """Builds the themes' templates as JSON now (at startup), not for the first visitor."""
    for name in TEMPLATES.values():
        _template_json(name)


def themed_layout(layout: dict[str, Any], theme: str | None) -> dict[str, Any]:
    """:func:`themed` for a layout dict: the theme's template, a transparent
    background (the card shows)."""
    layout["template"] = _template_json(template(theme))
    layout["paper_bgcolor"] = "rgba(0,0,0,0)"
    if theme == "dark":
        layout["plot_bgcolor"] = "rgba(0,0,0,0)"
    return layout


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


def placeholder(message: str) -> dict[str, Any]:
    """A graph's figure in a page's layout until its callback draws one: ``message`` on a
    transparent card, as Plotly's JSON. Built as a go.Figure (:func:`empty_figure`), two of
    them cost the overview's layout request ~0.15 s on 2 vCPU (their template serialized)."""
    return {
        "data": [],
        "layout": {
            "height": 260,
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "paper_bgcolor": "rgba(0,0,0,0)",
            "plot_bgcolor": "rgba(0,0,0,0)",
            "annotations": [
                {"text": message, "showarrow": False, "font": {"size": 14, "color": "#6b7280"}}
            ],
        },
    }


def band_figure(
    series: Series,
    *,
    title: str,
    revision: str,
    spikes: list[tuple[int, int, str]] | None = None,
) -> go.Figure:
    """Median across ranks as a line, min..max across ranks as a shaded band.

    ``spikes``: (step, rank, flag) to mark on the max line.
    """
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
            fillcolor=translucent(color),
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
    if spikes:
        top = dict(zip(series.step, series.max, strict=True))
        marked = [(step, rank, flag) for step, rank, flag in spikes if top.get(step) is not None]
        if marked:
            fig.add_trace(
                go.Scatter(
                    x=[m[0] for m in marked],
                    y=[top[m[0]] for m in marked],
                    name="spike",
                    mode="markers",
                    marker={"symbol": "triangle-down", "size": 11, "color": "#dc2626"},
                    text=[f"rank {rank}: {flag}" for _, rank, flag in marked],
                    hovertemplate="step %{x}<br>%{text}<extra></extra>",
                )
            )
    return _layout(fig, title=title, unit=series.unit, revision=revision)


def breakdown_figure(parts: dict[str, Series], *, revision: str) -> go.Figure:
    """Where the time went, per step, as a stacked area (run-level means over ranks)."""
    values = {name: dict(zip(s.step, s.total, strict=True)) for name, s in parts.items() if s.step}
    if "compute" in values and "overlapped_comm" in values:
        overlapped = values["overlapped_comm"]
        values["compute_only"] = {
            step: max(0.0, v - (overlapped.get(step) or 0.0))
            for step, v in values["compute"].items()
            if v is not None
        }
        layers = BREAKDOWN_COMM
    elif "forward" in values:
        layers = BREAKDOWN_PHASES
    else:
        layers = [layer("step_time"), layer("data_wait")]
    steps = sorted(values.get("step_time", {}))
    if not steps:
        return empty_figure("No step times yet: waiting for the first steps")
    fig = go.Figure()
    for key, label, color in layers:
        series = values.get(key)
        if not series:
            continue
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=[series.get(step) or 0.0 for step in steps],
                name=label,
                mode="lines",
                stackgroup="time",
                line={"width": 0.5, "color": color},
                hovertemplate=f"{label} %{{y:.3s}}s<extra></extra>",
            )
        )
    return _layout(fig, title="Step time breakdown", unit="s", revision=revision)


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


def translucent(hex_color: str, alpha: float = 0.18) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"
