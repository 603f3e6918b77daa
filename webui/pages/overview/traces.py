"""The overview figure's rows as Plotly's JSON, a function a kind of trace: a band
across ranks, a line, spikes, the step-time breakdown, the event markers, the replaced
executions; and the helpers for the series they draw (gaps, times, thinning).

Plotly's graph objects validate every value they are given: for six rows of a thousand
points that cost ~0.1 s a refresh (0.35 s on a process's first figure), then a deep copy
when Dash serializes. The figure is built as the JSON Plotly.js reads instead; tests
wrap it in ``go.Figure`` to check it (which validates it there).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from trainwarden.collector.read.schemas import Series

from ...charts import layer, translucent

if TYPE_CHECKING:
    from .figures import Marker, Overview


# The breakdown, bottom to top: (key, label, color). "other" is what the slowest rank's
# step holds beyond the mean compute and exposed comm: idle, and waiting for that rank.
BREAKDOWN = [
    layer("compute", "compute_only"),
    layer("overlapped_comm"),
    layer("exposed_comm"),
    layer("idle", "other", "other (idle, slowest rank)"),
    layer("data_wait"),
]
MARKER_STYLE = {  # (kind, tone): (symbol, color)
    ("alert", "bad"): ("triangle-down", "#dc2626"),
    ("alert", "warn"): ("triangle-down", "#d97706"),
    ("alert", "info"): ("triangle-down", "#2563eb"),
    ("action", "good"): ("diamond", "#059669"),
    ("action", "bad"): ("diamond", "#dc2626"),
    ("checkpoint", "good"): ("square", "#059669"),
    ("checkpoint", "warn"): ("square-open", "#d97706"),
    ("restart", "info"): ("star", "#6b7280"),
}
MAX_LINES = 40  # vertical lines across the rows (alerts and restarts); the rest are markers
REPLACED_COLOR = "#9ca3af"


def finite(values: Sequence[float | None]) -> list[float | None]:
    """``values`` with NaN and infinities as gaps (None): Plotly draws no point there."""
    return [v if v is not None and math.isfinite(v) else None for v in values]


def when(ts: float) -> dt.datetime:
    """A timestamp on the time axis (the server's local time, as on the other pages)."""
    return dt.datetime.fromtimestamp(ts)


def thin(
    steps: Sequence[int], ts: Sequence[float], values: Sequence[float | None], points: int
) -> tuple[list[int], list[float], list[float | None]]:
    """At most about ``points`` points of a line, keeping each bucket's lowest and highest
    value so that a spike survives the downsampling."""
    if len(steps) <= points:
        return list(steps), list(ts), list(values)
    width = -(-len(steps) // max(1, points // 2))
    keep: list[int] = []
    for start in range(0, len(steps), width):
        idx = [i for i in range(start, min(start + width, len(steps))) if ok(values[i])]
        if not idx:
            keep.append(start)
            continue
        lo = min(idx, key=lambda i: values[i])  # type: ignore[arg-type,return-value]
        hi = max(idx, key=lambda i: values[i])  # type: ignore[arg-type,return-value]
        keep.extend(sorted({lo, hi}))
    return [steps[i] for i in keep], [ts[i] for i in keep], [values[i] for i in keep]


def ok(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def xs(series_steps: Sequence[int], ts: Sequence[float], axis: str) -> list[Any]:
    return [when(t) for t in ts] if axis == "time" else list(series_steps)


def axes(row: int) -> tuple[str, str]:
    """The (x, y) axis ids of a row's traces: ``("x", "y")``, ``("x2", "y2")``, ..."""
    suffix = "" if row == 1 else str(row)
    return f"x{suffix}", f"y{suffix}"


def trace(row: int, **props: Any) -> dict[str, Any]:
    x, y = axes(row)
    return {"type": "scatter", "xaxis": x, "yaxis": y, **props}


def row_note(layout: dict[str, Any], row: int, text: str) -> None:
    """``text`` across an empty row, whose y-axis then has no tick labels (an empty axis
    would number a made-up range: 0-400 % on a run without MFU)."""
    x, y = axes(row)
    layout[y.replace("y", "yaxis", 1)]["showticklabels"] = False
    layout["annotations"].append(
        {
            "text": text,
            "showarrow": False,
            "xref": f"{x} domain",
            "yref": f"{y} domain",
            "x": 0.5,
            "y": 0.5,
            "font": {"size": 12, "color": "#6b7280"},
        }
    )


def add_band(
    traces: list[dict[str, Any]], s: Series, row: int, *, axis: str, color: str, label: str
) -> None:
    x = xs(s.step, s.ts, axis)
    group = f"band-{s.metric}"
    traces.append(
        trace(
            row,
            x=x,
            y=finite(s.max),
            mode="lines",
            line={"width": 0, "color": color},
            name=f"{label} max",
            legendgroup=group,
            showlegend=False,
            hoverinfo="skip",
        )
    )
    traces.append(
        trace(
            row,
            x=x,
            y=finite(s.min),
            mode="lines",
            line={"width": 0, "color": color},
            fill="tonexty",
            fillcolor=translucent(color),
            legendgroup=group,
            name=f"{label} min..max",
            showlegend=False,
            hoverinfo="skip",
        )
    )
    traces.append(
        trace(
            row,
            x=x,
            y=finite(s.median),
            mode="lines",
            line={"width": 2, "color": color},
            name=f"{label} median",
            legendgroup=group,
            showlegend=False,
            customdata=[
                [_num(lo), _num(hi), n] for lo, hi, n in zip(s.min, s.max, s.n, strict=False)
            ],
            hovertemplate=f"{label} median %{{y:.4g}}<br>min %{{customdata[0]}} · "
            "max %{customdata[1]}<br>%{customdata[2]} ranks<extra></extra>",
        )
    )


def _num(v: float | None) -> str:
    return f"{v:.4g}" if v is not None and math.isfinite(v) else "—"


def add_line(
    traces: list[dict[str, Any]],
    s: Series,
    row: int,
    *,
    axis: str,
    color: str,
    label: str,
    fmt: str = ".4s",
) -> None:
    traces.append(
        trace(
            row,
            x=xs(s.step, s.ts, axis),
            y=finite(s.total),
            mode="lines",
            line={"width": 2, "color": color},
            name=label,
            showlegend=False,
            hovertemplate=f"{label} %{{y:{fmt}}}<extra></extra>",
        )
    )


def add_spikes(
    traces: list[dict[str, Any]],
    data: Overview,
    s: Series,
    row: int,
    *,
    axis: str,
    flags: tuple[str, ...],
    label: str,
) -> None:
    found = [sp for sp in data.spikes if sp[2] in flags]
    if not found or not s.step:
        return
    top = max((v for v in finite(s.max) if v is not None), default=0.0)
    step_ts = dict(zip(s.step, s.ts, strict=False))
    xs: list[Any] = []
    ys: list[float | None] = []
    text: list[str] = []
    for step, rank, flag, value in found:
        if axis == "time":
            t = step_ts.get(step) or _ts_at(step, s.step, s.ts)
            xs.append(when(t))
        else:
            xs.append(step)
        ys.append(value if ok(value) else top)
        text.append(f"rank {rank}: {flag.replace('_', ' ')} at step {step}")
    traces.append(
        trace(
            row,
            x=xs,
            y=ys,
            mode="markers",
            name=label,
            text=text,
            marker={
                "symbol": "x",
                "size": 10,
                "color": "#dc2626",
                "line": {"width": 1, "color": "#dc2626"},
            },
            hovertemplate="%{text}<extra></extra>",
        )
    )


def _ts_at(step: int, steps: Sequence[int], ts: Sequence[float]) -> float:
    """The time of the point nearest ``step`` (steps ascending, not empty)."""
    i = min(range(len(steps)), key=lambda k: abs(steps[k] - step))
    return ts[i]


def breakdown_layers(
    series: dict[str, Series],
) -> tuple[list[int], list[float], dict[str, list[float]]]:
    """The stacked layers per step of the step_time series: compute not overlapped,
    overlapped comm, exposed comm, other (the slowest rank's step time beyond the mean
    compute and exposed comm) and data wait. Without a comm split: the step time."""
    base = series.get("step_time")
    if base is None or not base.step:
        return [], [], {}

    def at(metric: str) -> dict[int, float]:
        s = series.get(metric)
        if s is None:
            return {}
        return {st: v for st, v in zip(s.step, finite(s.total), strict=False) if v is not None}

    step_time, compute, exposed = at("step_time"), at("compute"), at("exposed_comm")
    overlapped, wait = at("overlapped_comm"), at("data_wait")
    layers: dict[str, list[float]] = {}
    if compute:
        layers["compute_only"] = [
            max(0.0, compute.get(s, 0.0) - overlapped.get(s, 0.0)) for s in base.step
        ]
        layers["overlapped_comm"] = [overlapped.get(s, 0.0) for s in base.step]
        layers["exposed_comm"] = [exposed.get(s, 0.0) for s in base.step]
        layers["other"] = [
            max(0.0, step_time.get(s, 0.0) - compute.get(s, 0.0) - exposed.get(s, 0.0))
            for s in base.step
        ]
    else:  # no comm split reported: the step as one layer
        layers["step_time"] = [step_time.get(s, 0.0) for s in base.step]
    if wait:
        layers["data_wait"] = [wait.get(s, 0.0) for s in base.step]
    return list(base.step), list(base.ts), layers


def add_breakdown(
    traces: list[dict[str, Any]], series: dict[str, Series], row: int, *, axis: str
) -> bool:
    steps, ts, layers = breakdown_layers(series)
    if not steps:
        return False
    x = xs(steps, ts, axis)
    styles = {key: (label, color) for key, label, color in BREAKDOWN}
    styles["step_time"] = ("step time (no comm split reported)", "#d97706")
    for key in [
        "compute_only",
        "overlapped_comm",
        "exposed_comm",
        "other",
        "step_time",
        "data_wait",
    ]:
        if key not in layers or not any(layers[key]):
            continue
        label, color = styles[key]
        traces.append(
            trace(
                row,
                x=x,
                y=layers[key],
                name=label,
                mode="lines",
                stackgroup="time",
                line={"width": 0.5, "color": color},
                hovertemplate=f"{label} %{{y:.3s}}s<extra></extra>",
            )
        )
    _spread(traces, series["step_time"], row, axis=axis)
    return True


# Step time across ranks over the stack (whose top is the slowest rank): (column, label, dash).
SPREAD = [
    ("p99", "step time p99 across ranks", "dash"),
    ("median", "step time median across ranks", "dot"),
]


def _spread(traces: list[dict[str, Any]], s: Series, row: int, *, axis: str) -> None:
    """Lines for the median and p99 step time over the stacked breakdown. The stack's top
    is the slowest rank; p99 near the median and far below that top is one straggler,
    p99 near the top is many slow ranks."""
    x = xs(s.step, s.ts, axis)
    for column, label, dash in SPREAD:
        values = getattr(s, column)
        if len(values) != len(s.step) or not any(ok(v) for v in values):
            continue  # a collector from before p99 sends none
        traces.append(
            trace(
                row,
                x=x,
                y=finite(values),
                name=label,
                mode="lines",
                line={"width": 1.5, "color": "#b45309", "dash": dash},
                hovertemplate=f"{label} %{{y:.3s}}s<extra></extra>",
            )
        )


def add_markers(
    traces: list[dict[str, Any]], layout: dict[str, Any], markers: list[Marker], *, axis: str
) -> None:
    placed = [mk for mk in markers if axis == "time" or mk.step is not None]
    for (kind, tone), (symbol, color) in MARKER_STYLE.items():
        group = [mk for mk in placed if mk.kind == kind and mk.tone == tone]
        if not group:
            continue
        x = [when(mk.ts) if axis == "time" else mk.step for mk in group]
        traces.append(
            trace(
                1,
                x=x,
                y=[kind] * len(group),
                mode="markers",
                name=f"{kind}",
                marker={"symbol": symbol, "size": 12, "color": color},
                text=[mk.text for mk in group],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    lines = [mk for mk in placed if mk.kind in ("alert", "restart")][-MAX_LINES:]
    for mk in lines:
        color = MARKER_STYLE.get((mk.kind, mk.tone), ("", "#6b7280"))[1]
        at: Any = when(mk.ts) if axis == "time" else mk.step
        layout["shapes"].append(
            {
                "type": "line",
                "xref": "x",
                "yref": "paper",
                "x0": at,
                "x1": at,
                "y0": 0,
                "y1": 1,
                "line": {"width": 1, "dash": "dot", "color": color},
                "opacity": 0.6,
                "layer": "below",
            }
        )


def add_replaced(
    traces: list[dict[str, Any]], data: Overview, metric: str, row: int, *, axis: str, label: str
) -> None:
    """The steps' earlier executions that a rollback or restart replaced, as a dashed
    line of their max across ranks: the spike a rollback went back from stays in sight."""
    r = data.replaced.get(metric)
    if r is None or not r.step:
        return
    traces.append(
        trace(
            row,
            x=xs(r.step, r.ts, axis),
            y=finite(r.max),
            mode="lines+markers",
            line={"width": 1.5, "color": REPLACED_COLOR, "dash": "dot"},
            marker={"size": 3, "color": REPLACED_COLOR},
            name="replaced (run again)",
            legendgroup="replaced",
            showlegend=metric == "loss" or "loss" not in data.replaced,
            customdata=[[_num(v), n] for v, n in zip(r.mean, r.n, strict=False)],
            hovertemplate=f"{label} before it was run again: max %{{y:.4g}}, mean "
            "%{customdata[0]} (%{customdata[1]} executions)<extra></extra>",
        )
    )


def scale_to_live(layout: dict[str, Any], row: int, data: Overview, metric: str) -> None:
    """Keep a row's y-axis on the run as it is when the replaced executions would squash
    it: a rolled-back 1000x spike made a loss of 2 a flat line at the bottom of a 0-300
    axis, and on-call could not see that the loss was back on its trend. The replaced
    line then runs off the top, and a note gives its peak."""
    r = data.replaced.get(metric)
    s = data.series.get(metric)
    if r is None or s is None:
        return
    peak = max((v for v in r.max if ok(v)), default=None)
    live = [v for v in (*s.min, *s.max) if ok(v)]
    if metric == "loss":
        live += [v for line in data.ranks for v in line.value if ok(v)]
    if peak is None or not live:
        return
    lo, hi = min(live), max(live)
    if peak - lo <= 2 * (hi - lo):  # the live data keeps at least half the row
        return
    pad = 0.1 * (hi - lo) or 0.1 * abs(hi) or 1.0
    x, y = axes(row)
    layout[y.replace("y", "yaxis", 1)]["range"] = [lo - pad, hi + pad]
    layout["annotations"].append(
        {
            "text": f"replaced (run again): peak {peak:.4g}, above this scale",
            "showarrow": False,
            "xref": f"{x} domain",
            "yref": f"{y} domain",
            "x": 1,
            "y": 1,
            "xanchor": "right",
            "yanchor": "top",
            "font": {"size": 11, "color": REPLACED_COLOR},
        }
    )
