"""The run overview as one figure: stacked rows on one shared x-axis (a pure function).

Rows, top to bottom: events (alerts, actions, checkpoints, restarts), throughput, MFU,
loss (min..max band across ranks, median, outlier ranks, spikes), grad norm (band,
median, spikes) and the step-time breakdown as a stacked area. The x-axis is the step
or the wall-clock time; zooming one row zooms them all (``shared_xaxes``).
"""

from __future__ import annotations

import copy
import datetime as dt
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from trainwarden.collector.incidents.report_format import MFU_FORMAT
from trainwarden.collector.read.schemas import ReplacedSeries, Series

from ...charts import COLORS, TEMPLATES, empty_figure, template, themed, translucent

ROWS = ["events", "throughput", "mfu", "loss", "grad_norm", "breakdown"]
ROW_TITLES = [
    "Alerts · actions · checkpoints · restarts",
    "Throughput (tokens/s, whole job)",
    "MFU (whole job)",
    "Loss: median, min..max across ranks",
    "Grad norm: median, min..max across ranks",
    "Step time breakdown (s); median and p99 across ranks",
]
ROW_HEIGHTS = [0.07, 0.16, 0.13, 0.26, 0.17, 0.21]
# What an empty row says, and what to do about it.
ROW_EMPTY = {
    "throughput": "No throughput: pass tokens= to tw.step(step, tokens=...)",
    "mfu": "No MFU: give tw.init flops_per_token (or flops_per_step) and a known GPU or peak_flops",
    "loss": "No loss: call s.loss(value) inside the step",
    "grad_norm": "No grad norm: call s.grad_norm(value) inside the step",
    "breakdown": "No step times yet",
}
# The breakdown, bottom to top: (key, label, color). "other" is what the slowest rank's
# step holds beyond the mean compute and exposed comm: idle, and waiting for that rank.
BREAKDOWN = [
    ("compute_only", "compute", "#2563eb"),
    ("overlapped_comm", "overlapped comm", "#60a5fa"),
    ("exposed_comm", "exposed comm", "#dc2626"),
    ("other", "other (idle, slowest rank)", "#9ca3af"),
    ("data_wait", "data wait", "#7c3aed"),
]
EVENT_ROWS = ["restart", "checkpoint", "action", "alert"]  # bottom to top in the events row
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
RANK_COLORS = ["#ea580c", "#16a34a", "#9333ea", "#0d9488"]
MAX_LINES = 40  # vertical lines across the rows (alerts and restarts); the rest are markers


@dataclass(frozen=True)
class Marker:
    """Something that happened in the run, drawn on the shared x-axis."""

    kind: str  # alert, action, checkpoint or restart
    ts: float
    step: int | None  # None: not placed on a step axis
    text: str  # the hover text: what it is
    tone: str = "info"  # bad, warn, good or info


@dataclass(frozen=True)
class RankLine:
    """One rank's loss, drawn over the band (an outlier, or the rank in the URL)."""

    rank: int
    why: str
    step: list[int]
    ts: list[float]
    value: list[float | None]


@dataclass
class Overview:
    """What the overview draws; :func:`overview_figure` makes the figure of it."""

    series: dict[str, Series]  # metric: per step across ranks
    spikes: list[tuple[int, int, str, float | None]] = field(default_factory=list)
    # (step, rank, flag, value) for flags of loss and grad norm
    ranks: list[RankLine] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    # metric: the executions of steps a rollback or restart ran again (loss, grad norm)
    replaced: dict[str, ReplacedSeries] = field(default_factory=dict)


REPLACED = ("loss", "grad_norm")  # rows that draw the replaced executions (their max)
REPLACED_COLOR = "#9ca3af"


def _replaced(
    traces: list[dict[str, Any]], data: Overview, metric: str, row: int, *, axis: str, label: str
) -> None:
    """The steps' earlier executions that a rollback or restart replaced, as a dashed
    line of their max across ranks: the spike a rollback went back from stays in sight."""
    r = data.replaced.get(metric)
    if r is None or not r.step:
        return
    traces.append(
        _trace(
            row,
            x=_xs(r.step, r.ts, axis),
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


def _scale_to_live(layout: dict[str, Any], row: int, data: Overview, metric: str) -> None:
    """Keep a row's y-axis on the run as it is when the replaced executions would squash
    it: a rolled-back 1000x spike made a loss of 2 a flat line at the bottom of a 0-300
    axis, and on-call could not see that the loss was back on its trend. The replaced
    line then runs off the top, and a note gives its peak."""
    r = data.replaced.get(metric)
    s = data.series.get(metric)
    if r is None or s is None:
        return
    peak = max((v for v in r.max if _ok(v)), default=None)
    live = [v for v in (*s.min, *s.max) if _ok(v)]
    if metric == "loss":
        live += [v for line in data.ranks for v in line.value if _ok(v)]
    if peak is None or not live:
        return
    lo, hi = min(live), max(live)
    if peak - lo <= 2 * (hi - lo):  # the live data keeps at least half the row
        return
    pad = 0.1 * (hi - lo) or 0.1 * abs(hi) or 1.0
    x, y = _axes(row)
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
        idx = [i for i in range(start, min(start + width, len(steps))) if _ok(values[i])]
        if not idx:
            keep.append(start)
            continue
        lo = min(idx, key=lambda i: values[i])  # type: ignore[arg-type,return-value]
        hi = max(idx, key=lambda i: values[i])  # type: ignore[arg-type,return-value]
        keep.extend(sorted({lo, hi}))
    return [steps[i] for i in keep], [ts[i] for i in keep], [values[i] for i in keep]


def _ok(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _xs(series_steps: Sequence[int], ts: Sequence[float], axis: str) -> list[Any]:
    return [when(t) for t in ts] if axis == "time" else list(series_steps)


# -- the figure as a plain dict ------------------------------------------------------
# Plotly's graph objects validate every value they are given: for six rows of a thousand
# points that cost ~0.1 s a refresh (0.35 s on a process's first figure), then a deep copy
# when Dash serializes. The figure is built as the JSON Plotly.js reads instead; tests
# wrap it in ``go.Figure`` to check it (which validates it there).


def _axes(row: int) -> tuple[str, str]:
    """The (x, y) axis ids of a row's traces: ``("x", "y")``, ``("x2", "y2")``, ..."""
    suffix = "" if row == 1 else str(row)
    return f"x{suffix}", f"y{suffix}"


def _trace(row: int, **props: Any) -> dict[str, Any]:
    x, y = _axes(row)
    return {"type": "scatter", "xaxis": x, "yaxis": y, **props}


@functools.cache
def _skeleton() -> dict[str, Any]:
    """The stacked rows' layout (axis domains, shared x, row titles), made once."""
    fig = make_subplots(
        rows=len(ROWS),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.035,
        row_heights=ROW_HEIGHTS,
        subplot_titles=ROW_TITLES,
    )
    layout: dict[str, Any] = fig.to_plotly_json()["layout"]
    layout.pop("template", None)
    for annotation in layout["annotations"]:  # the row titles: small, on the left
        annotation.update(x=0, xanchor="left", font={"size": 12})
    return layout


@functools.cache
def _template(name: str) -> dict[str, Any]:
    """A Plotly template as JSON (Plotly.js knows no template names). Shared: read only."""
    return go.layout.Template(pio.templates[name]).to_plotly_json()  # type: ignore[no-any-return]


def prepare() -> None:
    """Builds the rows' layout and the themes' templates now (at startup), not for the first
    visitor: ~0.2 s."""
    _skeleton()
    for name in TEMPLATES.values():
        _template(name)


def themed_layout(layout: dict[str, Any], theme: str | None) -> dict[str, Any]:
    """:func:`.figures.themed` for a layout dict: the theme's template, a transparent
    background (the card shows)."""
    layout["template"] = _template(template(theme))
    layout["paper_bgcolor"] = "rgba(0,0,0,0)"
    if theme == "dark":
        layout["plot_bgcolor"] = "rgba(0,0,0,0)"
    return layout


def _row_note(layout: dict[str, Any], row: int, text: str) -> None:
    """``text`` across an empty row, whose y-axis then has no tick labels (an empty axis
    would number a made-up range: 0-400 % on a run without MFU)."""
    x, y = _axes(row)
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


def _band(
    traces: list[dict[str, Any]], s: Series, row: int, *, axis: str, color: str, label: str
) -> None:
    x = _xs(s.step, s.ts, axis)
    group = f"band-{s.metric}"
    traces.append(
        _trace(
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
        _trace(
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
        _trace(
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


def _line(
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
        _trace(
            row,
            x=_xs(s.step, s.ts, axis),
            y=finite(s.total),
            mode="lines",
            line={"width": 2, "color": color},
            name=label,
            showlegend=False,
            hovertemplate=f"{label} %{{y:{fmt}}}<extra></extra>",
        )
    )


def _spikes(
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
        ys.append(value if _ok(value) else top)
        text.append(f"rank {rank}: {flag.replace('_', ' ')} at step {step}")
    traces.append(
        _trace(
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


def _breakdown(
    traces: list[dict[str, Any]], series: dict[str, Series], row: int, *, axis: str
) -> bool:
    steps, ts, layers = breakdown_layers(series)
    if not steps:
        return False
    x = _xs(steps, ts, axis)
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
            _trace(
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
    x = _xs(s.step, s.ts, axis)
    for column, label, dash in SPREAD:
        values = getattr(s, column)
        if len(values) != len(s.step) or not any(_ok(v) for v in values):
            continue  # a collector from before p99 sends none
        traces.append(
            _trace(
                row,
                x=x,
                y=finite(values),
                name=label,
                mode="lines",
                line={"width": 1.5, "color": "#b45309", "dash": dash},
                hovertemplate=f"{label} %{{y:.3s}}s<extra></extra>",
            )
        )


def _markers(
    traces: list[dict[str, Any]], layout: dict[str, Any], markers: list[Marker], *, axis: str
) -> None:
    placed = [mk for mk in markers if axis == "time" or mk.step is not None]
    for (kind, tone), (symbol, color) in MARKER_STYLE.items():
        group = [mk for mk in placed if mk.kind == kind and mk.tone == tone]
        if not group:
            continue
        x = [when(mk.ts) if axis == "time" else mk.step for mk in group]
        traces.append(
            _trace(
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


def overview_figure(
    data: Overview,
    *,
    axis: str = "step",
    theme: str | None = "light",
    revision: str = "",
    x_range: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The run overview, as Plotly's JSON. ``revision`` keeps the user's zoom and hidden
    traces across live refreshes; ``x_range`` (steps) is the range the data was read for,
    shown as it is."""
    base = data.series.get("step_time") or data.series.get("loss")
    if not any(s.step for s in data.series.values()) or base is None:
        fig = empty_figure(
            "No steps yet for this run. It fills in as its agents report steps."
            if x_range is None
            else "No steps in this range. Double-click the plot or press 'Whole run'."
        )
        fig.update_layout(uirevision=revision)
        return themed(fig, theme).to_plotly_json()  # type: ignore[no-any-return]
    layout = copy.deepcopy(_skeleton())
    layout["shapes"] = []
    traces: list[dict[str, Any]] = []
    _markers(traces, layout, data.markers, axis=axis)
    s = data.series
    drawn = {"events": True}
    drawn["throughput"] = _has(s, "tokens_per_s", "total")
    if drawn["throughput"]:
        _line(
            traces, s["tokens_per_s"], 2, axis=axis, color=COLORS["tokens_per_s"], label="tokens/s"
        )
    drawn["mfu"] = _has(s, "mfu", "total")
    if drawn["mfu"]:
        _line(traces, s["mfu"], 3, axis=axis, color=COLORS["mfu"], label="MFU", fmt=MFU_FORMAT)
    drawn["loss"] = _has(s, "loss", "median")
    if drawn["loss"]:
        _band(traces, s["loss"], 4, axis=axis, color=COLORS["loss"], label="loss")
        for i, line in enumerate(data.ranks):
            traces.append(
                _trace(
                    4,
                    x=_xs(line.step, line.ts, axis),
                    y=finite(line.value),
                    mode="lines",
                    name=f"rank {line.rank}",
                    line={"width": 1.3, "color": RANK_COLORS[i % len(RANK_COLORS)]},
                    hovertemplate=f"rank {line.rank} ({line.why}) %{{y:.4g}}<extra></extra>",
                )
            )
        _spikes(
            traces,
            data,
            s["loss"],
            4,
            axis=axis,
            label="loss spike",
            flags=("loss_spike", "nonfinite_loss"),
        )
        _replaced(traces, data, "loss", 4, axis=axis, label="loss")
        _scale_to_live(layout, 4, data, "loss")
    drawn["grad_norm"] = _has(s, "grad_norm", "median")
    if drawn["grad_norm"]:
        _band(traces, s["grad_norm"], 5, axis=axis, color=COLORS["grad_norm"], label="grad norm")
        _spikes(
            traces,
            data,
            s["grad_norm"],
            5,
            axis=axis,
            label="grad-norm spike",
            flags=("grad_norm_spike", "nonfinite_grad_norm"),
        )
        _replaced(traces, data, "grad_norm", 5, axis=axis, label="grad norm")
        _scale_to_live(layout, 5, data, "grad_norm")
    drawn["breakdown"] = _breakdown(traces, s, 6, axis=axis)
    for row, name in enumerate(ROWS, start=1):
        if not drawn[name]:
            _row_note(layout, row, ROW_EMPTY[name])
        # An axis no trace refers to is not drawn (nor its note): give each row one.
        traces.append(_trace(row, x=[], y=[], name="", showlegend=False, hoverinfo="skip"))
    layout.update(
        height=940,
        margin={"l": 64, "r": 24, "t": 36, "b": 40},
        hovermode="x unified",
        legend={
            "orientation": "h",
            "y": 1.035,
            "x": 1,
            "xanchor": "right",
            "yanchor": "bottom",
            "font": {"size": 11},
            "traceorder": "normal",
        },
        uirevision=revision,
        dragmode="zoom",
    )
    # Drag selects a range of steps (or time); the y-axes follow the data in it.
    xrev = f"{revision}|{x_range}"
    for row in range(1, len(ROWS) + 1):
        x, y = _axes(row)
        yaxis, xaxis = layout[y.replace("y", "yaxis", 1)], layout[x.replace("x", "xaxis", 1)]
        # The margins are fixed (64 px on the left: room for short tick labels such as
        # "10M", "40%" or "0.25", as plotly formats them), and
        # tick labels are not tested for overflowing the page: plotly.js measures every
        # label again as each one is placed, then draws again for the margins it finds.
        # Both cost 70 ms of a 250 ms first draw in Chromium (2026-11-27). A date axis's
        # labels take two lines: the margin below then grows to fit them.
        yaxis.update(fixedrange=True, automargin=False, ticklabeloverflow="allow")
        # One type for all: an axis with no data would guess "linear" and stop matching a date axis.
        xaxis.update(
            automargin=axis == "time",
            ticklabeloverflow="allow",
            type="date" if axis == "time" else "linear",
            uirevision=xrev,
            showspikes=True,
            spikemode="across",
            spikethickness=1,
            spikedash="dot",
            spikecolor="#9ca3af",
        )
        if x_range is not None:
            if axis == "time":
                xaxis["range"] = [when(base.ts[0]), when(base.ts[-1])] if base.ts else None
            else:
                xaxis["range"] = list(x_range)
    layout["yaxis"].update(
        type="category",
        categoryorder="array",
        categoryarray=EVENT_ROWS,
        showticklabels=False,
        showgrid=False,
    )
    layout["yaxis3"]["tickformat"] = MFU_FORMAT
    for row in (2, 3, 6):  # throughput, MFU and time from zero: a drop reads as a drop
        layout[f"yaxis{row}"]["rangemode"] = "tozero"
    layout[f"xaxis{len(ROWS)}"]["title"] = {"text": "time" if axis == "time" else "step"}
    return {"data": traces, "layout": themed_layout(layout, theme)}


USER_COLOR = "#0d9488"


def user_figure(
    s: Series, *, axis: str = "step", theme: str | None = "light", revision: str = ""
) -> dict[str, Any]:
    """One user metric (``s.metric``) across ranks: the min..max band, the median, and the
    p99 dashed (a few ranks apart from the rest show between p99 and max)."""
    label = s.metric.removeprefix("user.")
    title = {
        "text": f"{label}: median, p99, min..max across ranks",
        "x": 0.01,
        "font": {"size": 15},
    }
    if not any(_ok(v) for v in s.median):
        fig = empty_figure(f"No values of {label} in these steps.")
        fig.update_layout(title=title, uirevision=revision)
        return themed(fig, theme).to_plotly_json()  # type: ignore[no-any-return]
    traces: list[dict[str, Any]] = []
    _band(traces, s, 1, axis=axis, color=USER_COLOR, label=label)
    if len(s.p99) == len(s.step) and any(_ok(v) for v in s.p99):
        traces.append(
            _trace(
                1,
                x=_xs(s.step, s.ts, axis),
                y=finite(s.p99),
                mode="lines",
                line={"width": 1.2, "color": USER_COLOR, "dash": "dash"},
                name=f"{label} p99",
                showlegend=False,
                hovertemplate=f"{label} p99 %{{y:.4g}}<extra></extra>",
            )
        )
    layout = {
        "title": title,
        "height": 280,
        "margin": {"l": 64, "r": 24, "t": 40, "b": 40},
        "hovermode": "x unified",
        "uirevision": revision,
        "showlegend": False,
        "xaxis": {
            "title": {"text": "time" if axis == "time" else "step"},
            "type": "date" if axis == "time" else "linear",
        },
        "yaxis": {"automargin": True},
    }
    return {"data": traces, "layout": themed_layout(layout, theme)}


def _has(series: dict[str, Series], metric: str, column: str) -> bool:
    s = series.get(metric)
    return s is not None and any(_ok(v) for v in getattr(s, column))
