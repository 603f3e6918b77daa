"""The hardware page's graphs, as pure functions of GPU readings: one reading
(temperature, power, SM clock) over time, a line per GPU or, for many, a band."""

from __future__ import annotations

import datetime as dt
import statistics
from collections.abc import Sequence

import plotly.graph_objects as go

from trainwarden.collector.read.schemas import GpuSample

from ...charts import empty_figure, themed
from .panels import HOT_C, finite

LINES = 12  # past this many GPUs a graph draws min / median / max and the worst GPUs
FIELDS = {  # graph key -> (sample field, title, unit)
    "temp": ("temp_c", "GPU temperature", "°C"),
    "power": ("power_w", "Power", "W"),
    "clock": ("sm_clock_mhz", "SM clock", "MHz"),
}


def gpu_figure(
    samples: Sequence[GpuSample], key: str, *, theme: str | None, revision: str, lines: int = LINES
) -> go.Figure:
    """One reading over time: a line per GPU; past ``lines`` GPUs, the min..max band and
    median across GPUs plus the GPUs that peaked highest (lowest, for clocks)."""
    field, title, unit = FIELDS[key]
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for s in samples:
        v = finite(getattr(s, field))
        if v is not None:
            by_rank.setdefault(s.rank, []).append((s.ts, v))
    if not by_rank:
        return themed(empty_figure(f"No {title.lower()} readings"), theme)
    fig = go.Figure()
    worst_first = key != "clock"
    if len(by_rank) > lines:
        _band(fig, by_rank, unit)
        peak = {r: (max if worst_first else min)(v for _, v in pts) for r, pts in by_rank.items()}
        shown = sorted(peak, key=lambda r: -peak[r] if worst_first else peak[r])[:3]
    else:
        shown = sorted(by_rank)
    for rank in shown:
        pts = by_rank[rank]
        fig.add_trace(
            go.Scatter(
                x=[_when(t) for t, _ in pts],
                y=[v for _, v in pts],
                mode="lines",
                name=f"rank {rank}",
                hovertemplate=f"rank {rank} %{{y:.0f}} {unit}<extra></extra>",
            )
        )
    if key == "temp":
        fig.add_hline(
            y=HOT_C,
            line={"color": "#dc2626", "width": 1, "dash": "dot"},
            annotation_text="thermal slowdown",
            annotation_position="top left",
        )
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}},
        height=260,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        hovermode="x unified",
        uirevision=revision,
        legend={"orientation": "h", "y": 1.12, "x": 1, "xanchor": "right"},
    )
    fig.update_yaxes(title_text=unit)
    return themed(fig, theme)


def _band(fig: go.Figure, by_rank: dict[int, list[tuple[float, float]]], unit: str) -> None:
    """min / median / max across GPUs per 5 s of readings."""
    slots: dict[int, list[float]] = {}
    for pts in by_rank.values():
        for t, v in pts:
            slots.setdefault(int(t // 5), []).append(v)
    keys = sorted(slots)
    x = [_when(k * 5.0) for k in keys]
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[max(slots[k]) for k in keys],
            mode="lines",
            line={"width": 0},
            showlegend=False,
            hoverinfo="skip",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[min(slots[k]) for k in keys],
            mode="lines",
            line={"width": 0},
            fill="tonexty",
            fillcolor="rgba(156,163,175,0.3)",
            name="min..max across GPUs",
            hoverinfo="skip",
        )
    )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[statistics.median(slots[k]) for k in keys],
            mode="lines",
            line={"color": "#6b7280", "width": 1.5},
            name="median",
            hovertemplate=f"median %{{y:.0f}} {unit}<extra></extra>",
        )
    )


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).isoformat(timespec="seconds")
