"""Figures and tables of the ranks page, as pure functions of query results.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import plotly.graph_objects as go
from dash import dcc, html

from trainwarden.collector.read.schemas import (
    EventOut,
    GpuSample,
    Heatmap,
    RankInfo,
    RankSeries,
    Series,
)

from ...charts import empty_figure, themed
from ..overview.figures import themed_layout

# Rank states in the order a reader triages them; the collector's health pass sets them.
STATES = ("dead", "hung", "slow", "evicted", "running", "healthy", "finished")
STATE_HELP = {
    "dead": "no heartbeat: the process is gone or its node is unreachable",
    "hung": "heartbeats arrive but no step completes",
    "slow": "completes steps, slower than its peers",
    "evicted": "its node was taken out of the job",
    "running": "reporting; not yet judged",
    "healthy": "in step with its peers",
    "finished": "ended its run cleanly",
}
RANK_ROWS = 64  # the states table lists every rank up to this; past it, only the unhealthy
QUIET = ("healthy", "running", "finished")  # states a long list need not show


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


# -- rank states and one rank's detail -------------------------------------------


def state_counts(ranks: Sequence[RankInfo]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in ranks:
        counts[r.state] = counts.get(r.state, 0) + 1
    order = {s: i for i, s in enumerate(STATES)}
    return dict(sorted(counts.items(), key=lambda kv: order.get(kv[0], -1)))


def rank_href(run: str, rank: int, search: str = "") -> str:
    return f"/runs/{quote(run, safe='')}/ranks?{search + '&' if search else ''}rank={rank}"


def states_table(
    run: str, ranks: Sequence[RankInfo], *, selected: int | None, keep: str = ""
) -> html.Div:
    """State counts, then a row per rank (past RANK_ROWS ranks, only the unhealthy ones)
    linking to its detail; ``keep`` is the query string the links carry (the range)."""
    if not ranks:
        return html.Div(html.P("No rank has reported yet.", className="hint"))
    chips = [
        html.Span(
            f"{n} {state}", className=f"status status-{state}", title=STATE_HELP.get(state, "")
        )
        for state, n in state_counts(ranks).items()
    ]
    # Past RANK_ROWS ranks, only those in trouble, and at most RANK_ROWS of them: a table
    # of thousands of rows takes the browser minutes to draw (Dash renders each cell).
    shown = list(ranks) if len(ranks) <= RANK_ROWS else [r for r in ranks if r.state not in QUIET]
    order = {s: i for i, s in enumerate(STATES)}
    shown.sort(key=lambda r: (order.get(r.state, -1), r.rank))
    shown = shown[:RANK_ROWS]
    rows = []
    for r in shown:
        detail = r.state_detail or {}
        role = f"{detail['role']}: " if detail.get("role") else ""
        rows.append(
            html.Tr(
                [
                    html.Td(
                        dcc.Link(
                            str(r.rank), href=rank_href(run, r.rank, keep), className="rank-link"
                        )
                    ),
                    html.Td(r.node or r.host or "—"),
                    html.Td(html.Span(r.state, className=f"status status-{r.state}")),
                    html.Td(role + str(detail.get("reason", "")), className="detail"),
                    html.Td("—" if r.last_step is None else r.last_step),
                ],
                className="rank-row rank-selected" if r.rank == selected else "rank-row",
                id=f"ranks-row-{r.rank}",
            )
        )
    hidden = len(ranks) - len(shown)
    note = (
        html.P(
            f"{hidden} ranks not listed (the healthy first); click a heatmap row for any rank.",
            className="hint",
        )
        if hidden
        else None
    )
    table = (
        html.Table(
            [
                html.Thead(html.Tr([html.Th(h) for h in ("Rank", "Node", "State", "Why", "Step")])),
                html.Tbody(rows),
            ],
            className="runs-table ranks-table",
        )
        if rows
        else None
    )
    return html.Div([html.Div(chips, className="state-chips"), table, note])


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


def rank_facts(info: RankInfo, gpu: GpuSample | None, events: Sequence[EventOut]) -> html.Div:
    """Who the rank is, its state and why, its GPU now, and its latest events."""
    detail = info.state_detail or {}
    facts: list[tuple[str, Any]] = [
        ("state", html.Span(info.state, className=f"status status-{info.state}")),
        ("node", info.node or info.host or "—"),
        ("local rank", "—" if info.local_rank is None else str(info.local_rank)),
        ("pid", "—" if info.pid is None else str(info.pid)),
        ("last step", "—" if info.last_step is None else str(info.last_step)),
    ]
    if detail.get("reason"):
        facts.append(("why", str(detail["reason"])))
    if gpu is not None:
        parts = [gpu.gpu_name or "GPU"]
        if gpu.temp_c is not None:
            parts.append(f"{gpu.temp_c:.0f} °C")
        if gpu.throttle:
            parts.append("throttled: " + ", ".join(gpu.throttle))
        if gpu.simulated:
            parts.append("(simulated)")
        facts.append(("GPU", " · ".join(parts)))
    items = [
        html.Li(
            [
                html.Span(e.kind, className="fact-key"),
                html.Span(_event_line(e), className=f"sev-{e.severity}"),
            ]
        )
        for e in list(events)[-6:][::-1]
    ]
    return html.Div(
        [
            html.Div(
                [
                    html.Span([html.Span(k, className="fact-key"), v], className="fact")
                    for k, v in facts
                ],
                className="facts",
            ),
            html.Ul(items, className="events") if items else None,
        ]
    )


def _event_line(e: EventOut) -> str:
    d = e.data or {}
    step = f"step {e.step}: " if e.step is not None else ""
    if e.kind == "xid":
        return f"{step}XID {d.get('code')} {d.get('name', '')}: {d.get('meaning', '')}"
    if e.kind == "rank_state":
        return f"{step}{d.get('from')} → {d.get('to')}" + (
            f": {d['reason']}" if d.get("reason") else ""
        )
    if e.kind == "drill":
        return f"{step}drill injected: {d.get('spec') or d.get('fault')}"
    if e.kind == "rank_conflict":  # which processes collide: pid, node, session of each
        return f"duplicate rank: {d.get('reason', '')}"
    return step + ", ".join(f"{k}={v}" for k, v in list(d.items())[:4])
