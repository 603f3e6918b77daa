"""The run overview as one figure: stacked rows on one shared x-axis (a pure function,
of Plotly's JSON: see :mod:`.traces`).

Rows, top to bottom: events (alerts, actions, checkpoints, restarts), throughput, MFU,
loss (min..max band across ranks, median, outlier ranks, spikes), grad norm (band,
median, spikes) and the step-time breakdown as a stacked area. The x-axis is the step
or the wall-clock time; zooming one row zooms them all (``shared_xaxes``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

from plotly.subplots import make_subplots

from trainwarden.collector.incidents.report_format import MFU_FORMAT
from trainwarden.collector.read.schemas import ReplacedSeries, Series

from ...charts import COLORS, empty_figure, prepare_templates, themed, themed_layout
from ...components import metric_label
from . import traces as tr
from .traces import finite, when

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
EVENT_ROWS = ["restart", "checkpoint", "action", "alert"]  # bottom to top in the events row
RANK_COLORS = ["#ea580c", "#16a34a", "#9333ea", "#0d9488"]


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


def prepare() -> None:
    """Builds the rows' layout and the themes' templates now (at startup), not for the first
    visitor: ~0.2 s."""
    _skeleton()
    prepare_templates()


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
    tr.add_markers(traces, layout, data.markers, axis=axis)
    s = data.series
    drawn = {"events": True}
    drawn["throughput"] = _has(s, "tokens_per_s", "total")
    if drawn["throughput"]:
        tr.add_line(
            traces, s["tokens_per_s"], 2, axis=axis, color=COLORS["tokens_per_s"], label="tokens/s"
        )
    drawn["mfu"] = _has(s, "mfu", "total")
    if drawn["mfu"]:
        tr.add_line(
            traces, s["mfu"], 3, axis=axis, color=COLORS["mfu"], label="MFU", fmt=MFU_FORMAT
        )
    drawn["loss"] = _has(s, "loss", "median")
    if drawn["loss"]:
        tr.add_band(traces, s["loss"], 4, axis=axis, color=COLORS["loss"], label="loss")
        for i, line in enumerate(data.ranks):
            traces.append(
                tr.trace(
                    4,
                    x=tr.xs(line.step, line.ts, axis),
                    y=finite(line.value),
                    mode="lines",
                    name=f"rank {line.rank}",
                    line={"width": 1.3, "color": RANK_COLORS[i % len(RANK_COLORS)]},
                    hovertemplate=f"rank {line.rank} ({line.why}) %{{y:.4g}}<extra></extra>",
                )
            )
        tr.add_spikes(
            traces,
            data,
            s["loss"],
            4,
            axis=axis,
            label="loss spike",
            flags=("loss_spike", "nonfinite_loss"),
        )
        tr.add_replaced(traces, data, "loss", 4, axis=axis, label="loss")
        tr.scale_to_live(layout, 4, data, "loss")
    drawn["grad_norm"] = _has(s, "grad_norm", "median")
    if drawn["grad_norm"]:
        tr.add_band(
            traces, s["grad_norm"], 5, axis=axis, color=COLORS["grad_norm"], label="grad norm"
        )
        tr.add_spikes(
            traces,
            data,
            s["grad_norm"],
            5,
            axis=axis,
            label="grad-norm spike",
            flags=("grad_norm_spike", "nonfinite_grad_norm"),
        )
        tr.add_replaced(traces, data, "grad_norm", 5, axis=axis, label="grad norm")
        tr.scale_to_live(layout, 5, data, "grad_norm")
    drawn["breakdown"] = tr.add_breakdown(traces, s, 6, axis=axis)
    for row, name in enumerate(ROWS, start=1):
        if not drawn[name]:
            tr.row_note(layout, row, ROW_EMPTY[name])
        # An axis no trace refers to is not drawn (nor its note): give each row one.
        traces.append(tr.trace(row, x=[], y=[], name="", showlegend=False, hoverinfo="skip"))
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
        x, y = tr.axes(row)
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
    label = metric_label(s.metric)
    title = {
        "text": f"{label}: median, p99, min..max across ranks",
        "x": 0.01,
        "font": {"size": 15},
    }
    if not any(tr.ok(v) for v in s.median):
        fig = empty_figure(f"No values of {label} in these steps.")
        fig.update_layout(title=title, uirevision=revision)
        return themed(fig, theme).to_plotly_json()  # type: ignore[no-any-return]
    traces: list[dict[str, Any]] = []
    tr.add_band(traces, s, 1, axis=axis, color=USER_COLOR, label=label)
    if len(s.p99) == len(s.step) and any(tr.ok(v) for v in s.p99):
        traces.append(
            tr.trace(
                1,
                x=tr.xs(s.step, s.ts, axis),
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
    return s is not None and any(tr.ok(v) for v in getattr(s, column))
