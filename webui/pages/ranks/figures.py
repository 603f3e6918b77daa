"""Figures of the ranks page, as pure functions of query results.

A heatmap is rank (rows) x bucket (columns); the collector buckets steps on the server
(:func:`trainwarden.collector.read.series.heatmap`), GPU readings are bucketed here by time.
Heatmap figures are returned as plain dicts (Plotly's JSON) with the cells as a typed
array: validating 200,000 cells through ``go.Heatmap`` costs more than half a second,
printing them as JSON numbers a quarter, and the page's first graph has 1.5 s.
"""

from __future__ import annotations

import base64
import datetime as dt
import itertools
import math
import statistics
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from trainwarden.collector.read.schemas import GpuSample, Heatmap, RankSeries, Series

from ...charts import empty_figure, themed, themed_layout


@dataclass(frozen=True)
class Grid:
    """Values per rank (rows) and bucket (columns), ready for a heatmap.

    ``x`` holds each bucket's start (a step, or a Unix time) and ``width`` its size.
    Missing and non-finite values are ``None``.
    """

    ranks: list[int]
    x: list[float]
    width: float
    values: list[list[float | None]]
    unit: str


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def typed_cells(values: list[list[float | None]]) -> dict[str, str]:
    """Cells as a Plotly.js typed array: float32, little-endian, NaN for a gap, base64.
    Plotly.js copies it as it is, where JSON would make it parse 200,000 numbers, and
    Python encodes it in milliseconds, where printing each number took a quarter second."""
    flat = array("f", [math.nan if v is None else v for row in values for v in row])
    if sys.byteorder == "big":
        flat.byteswap()
    shape = f"{len(values)}, {len(values[0]) if values else 0}"
    return {
        "dtype": "f4",
        "bdata": base64.b64encode(flat.tobytes()).decode("ascii"),
        "shape": shape,
    }


def cells(z: Any) -> list[list[float | None]]:
    """A heatmap's cells as lists (gaps as None), from a typed array or from lists."""
    if not isinstance(z, dict):
        return z  # type: ignore[no-any-return]
    flat = array("f")
    flat.frombytes(base64.b64decode(z["bdata"]))
    if sys.byteorder == "big":
        flat.byteswap()
    rows, cols = (int(n) for n in str(z["shape"]).split(","))
    return [
        [None if math.isnan(v) else v for v in flat[i * cols : (i + 1) * cols]] for i in range(rows)
    ]


def grid_of(heatmap: Heatmap) -> Grid:
    """The collector's heatmap as a grid (NaN and infinities become gaps)."""
    values = [
        [v if v is not None and math.isfinite(v) else None for v in row] for row in heatmap.values
    ]
    return Grid(
        list(heatmap.ranks),
        [float(s) for s in heatmap.step_start],
        float(heatmap.bucket),
        values,
        heatmap.unit,
    )


def column_medians(grid: Grid) -> list[float | None]:
    out: list[float | None] = []
    for cells in zip(*grid.values, strict=True) if grid.values else [()] * len(grid.x):
        column = [v for v in cells if v is not None]
        out.append(statistics.median(column) if column else None)  # type: ignore[type-var]
    return out


def deviation(grid: Grid) -> Grid:
    """Each cell minus the median across ranks of its bucket (loss deviation: a rank
    whose loss drifts from its peers is a stripe; the run's falling loss is not)."""
    medians = column_medians(grid)
    values = [
        [None if v is None or m is None else v - m for v, m in zip(row, medians, strict=True)]
        for row in grid.values
    ]
    return Grid(grid.ranks, grid.x, grid.width, values, grid.unit)


def gpu_grid(samples: Iterable[GpuSample], *, field: str = "temp_c", buckets: int = 120) -> Grid:
    """A GPU reading per rank and time bucket (the bucket's max: a hot spell stays visible).

    A bucket is never narrower than the agents' sampling interval (the median gap
    between a rank's readings): narrower, a short run's row was a comb of empty cells."""
    points = [(s.rank, s.ts, _finite(getattr(s, field))) for s in samples]
    points = [p for p in points if p[2] is not None]
    if not points:
        return Grid([], [], 1.0, [], "°C")
    lo = min(p[1] for p in points)
    hi = max(p[1] for p in points)
    width = max((hi - lo) / buckets, _sampling_interval(points), 1.0)
    count = int((hi - lo) // width) + 1
    ranks = sorted({p[0] for p in points})
    index = {rank: i for i, rank in enumerate(ranks)}
    values: list[list[float | None]] = [[None] * count for _ in ranks]
    for rank, ts, value in points:
        row, i = values[index[rank]], int((ts - lo) // width)
        if row[i] is None or value > row[i]:  # type: ignore[operator]
            row[i] = value
    return Grid(ranks, [lo + i * width for i in range(count)], width, values, "°C")


def _sampling_interval(points: list[tuple[int, float, float | None]]) -> float:
    """The median gap between successive readings of the same rank (0 with too few)."""
    by_rank: dict[int, list[float]] = {}
    for rank, ts, _ in points:
        by_rank.setdefault(rank, []).append(ts)
    gaps = [
        b - a for times in by_rank.values() for a, b in itertools.pairwise(sorted(times)) if b > a
    ]
    return statistics.median(gaps) if gaps else 0.0


def row_ratios(grid: Grid) -> dict[int, float]:
    """Per rank: the median over buckets of (its value / the bucket's median across
    ranks). A straggler's row is well above 1; everyone else is near 1."""
    medians = column_medians(grid)
    out = {}
    for rank, row in zip(grid.ranks, grid.values, strict=True):
        ratios = [v / m for v, m in zip(row, medians, strict=True) if v is not None and m]
        if ratios:
            out[rank] = statistics.median(ratios)
    return out


def stripes(grid: Grid, *, ratio: float = 1.3, top: int = 5) -> list[tuple[int, float]]:
    """The ranks whose row stands out (``ratio`` x their peers or more), worst first."""
    if len(grid.ranks) < 2:
        return []
    found = [(rank, r) for rank, r in row_ratios(grid).items() if r >= ratio]
    return sorted(found, key=lambda item: -item[1])[:top]


def heatmap_figure(
    grid: Grid,
    *,
    title: str,
    theme: str | None,
    revision: str,
    x_title: str = "step",
    selected: int | None = None,
    diverging: bool = False,
    empty: str = "No data yet: waiting for the first steps",
) -> dict[str, Any]:
    """A rank x bucket heatmap; ``selected`` rank is outlined; ``diverging`` centres the
    colours on 0 (deviations). ``uirevision`` keeps the user's zoom across refreshes."""
    if not any(v is not None for row in grid.values for v in row):
        fig = themed(empty_figure(empty), theme)
        fig.update_layout(
            title={"text": title, "x": 0.01, "font": {"size": 15}}, uirevision=revision
        )
        return fig.to_plotly_json()  # type: ignore[no-any-return]
    unit = f" {grid.unit}" if grid.unit else ""
    time_axis = x_title == "time"
    x: list[Any] = [_iso(t) for t in grid.x] if time_axis else grid.x
    trace: dict[str, Any] = {
        "type": "heatmap",
        "z": typed_cells(grid.values),
        "x": x,
        "y": grid.ranks,
        "xgap": 0,
        "ygap": 1 if len(grid.ranks) <= 64 else 0,
        # Plotly's RdBu runs blue (low) to red (high): red is above the median. YlOrRd
        # reversed runs pale (low) to dark red (high): the slow, the hot stand out.
        "colorscale": "RdBu" if diverging else "YlOrRd",
        "reversescale": not diverging,
        "colorbar": {"title": {"text": grid.unit or ""}, "thickness": 12},
        "hoverongaps": False,
        "hovertemplate": f"rank %{{y}}<br>{x_title} %{{x}}<br>%{{z:.4g}}{unit}<extra></extra>",
    }
    if diverging:
        trace["zmid"] = 0
    elif all(v == 0 for row in grid.values for v in row if v is not None):  # (some are not)
        # All zero (exposed comm of a run without a process group, on the profiler's
        # sampled steps): the palest colour, not the middle of a -0.5..0.5 scale.
        trace.update(zmin=0, zmax=1)
    # Fixed margins, wide enough for the rank numbers on the left and the colour bar on
    # the right: plotly.js measured the labels and drew again for margins that fit them,
    # 60 of a 220 ms first draw of 1,024 ranks in Chromium (2026-11-27). A date axis's
    # labels take two lines: the margin below then grows to fit them.
    digits = len(str(max(grid.ranks, default=0)))
    layout: dict[str, Any] = {
        "title": {"text": title, "x": 0.01, "font": {"size": 15}},
        "height": min(640, max(220, 90 + 14 * len(grid.ranks))),
        "margin": {"l": 36 + 7 * digits, "r": 90, "t": 40, "b": 40},
        "uirevision": revision,
        "clickmode": "event",
        "xaxis": {
            "title": {"text": x_title},
            "type": "date" if time_axis else "linear",
            "automargin": time_axis,
            "ticklabeloverflow": "allow",
        },
        "yaxis": {
            "title": {"text": "rank"},
            "autorange": "reversed",
            "type": "linear",
            "automargin": False,
            "ticklabeloverflow": "allow",
        },
    }
    if len(grid.ranks) <= 16:
        layout["yaxis"]["dtick"] = 1
    if selected is not None and selected in grid.ranks:
        layout["shapes"] = [
            {
                "type": "rect",
                "xref": "x domain",
                "yref": "y",
                "x0": 0,
                "x1": 1,
                "y0": selected - 0.5,
                "y1": selected + 0.5,
                "line": {"color": "#2563eb", "width": 2},
            }
        ]
    return {"data": [trace], "layout": themed_layout(layout, theme)}


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts).isoformat(timespec="seconds")


def rank_figure(mine: RankSeries, run: Series, *, theme: str | None, revision: str) -> go.Figure:
    """One rank's step time against the run's median and slowest rank per step."""
    if not mine.step:
        return themed(empty_figure(f"Rank {mine.rank} has no steps in this range"), theme)
    fig = go.Figure()
    if run.step:
        fig.add_trace(
            go.Scatter(
                x=run.step,
                y=run.median,
                name="run median",
                mode="lines",
                line={"color": "#9ca3af", "width": 1.5},
            )
        )
        fig.add_trace(
            go.Scatter(
                x=run.step,
                y=run.max,
                name="slowest rank",
                mode="lines",
                line={"color": "#9ca3af", "width": 1, "dash": "dot"},
            )
        )
    fig.add_trace(
        go.Scatter(
            x=mine.step,
            y=[_finite(v) for v in mine.value],
            name=f"rank {mine.rank}",
            mode="lines",
            line={"color": "#d97706", "width": 2},
        )
    )
    fig.update_layout(
        title={"text": f"Rank {mine.rank}: step time", "x": 0.01, "font": {"size": 15}},
        height=260,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        hovermode="x unified",
        uirevision=revision,
        legend={"orientation": "h", "y": 1.12, "x": 1, "xanchor": "right"},
    )
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text=mine.unit or None)
    return themed(fig, theme)
