"""The run page's figure, as a pure function of the run's goodput: where the allocation
went, as one stacked bar."""

from __future__ import annotations

from typing import Any

from ...charts import layer

# Where the allocation went, left to right: what was kept, then the losses.
BREAKDOWN = (
    ("kept", "kept", "#059669"),
    ("replayed", "replayed", "#dc2626"),
    ("recovery", "recovery", "#d97706"),
    ("checkpoint", "checkpoint", "#2563eb"),
    layer("data_wait"),
    ("other", "other", "#9ca3af"),
)
# Plotly templates live in plotly.py, not plotly.js: a dict figure carries its colours.
INK = {"light": ("#111827", "#e5e7eb"), "dark": ("#e5e7eb", "#374151")}  # text, grid


def breakdown_figure(
    good: dict[str, Any] | None, *, theme: str | None, revision: str
) -> dict[str, Any]:
    """The allocation as one horizontal stacked bar, in percent, GPU-hours on hover."""
    ink, grid = INK.get(theme or "light", INK["light"])
    layout: dict[str, Any] = {
        "barmode": "stack",
        "height": 150,
        "margin": {"l": 10, "r": 10, "t": 10, "b": 30},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"color": ink, "size": 12},
        "uirevision": revision,
        "legend": {"orientation": "h", "y": -0.45, "x": 0, "traceorder": "normal"},
        "xaxis": {
            "range": [0, 100],
            "ticksuffix": "%",
            "gridcolor": grid,
            "zeroline": False,
            "fixedrange": True,
        },
        "yaxis": {"visible": False, "fixedrange": True},
    }
    total = (good or {}).get("allocation_gpu_s") or 0.0
    if total <= 0:
        layout["xaxis"]["visible"] = False
        layout["annotations"] = [
            {
                "text": "No allocation yet: waiting for the run's first steps",
                "showarrow": False,
                "font": {"color": "#6b7280"},
            }
        ]
        return {"data": [], "layout": layout}
    parts = (good or {}).get("breakdown_gpu_s") or {}
    data = []
    for key, label, color in BREAKDOWN:
        gpu_s = float(parts.get(key) or 0.0)
        pct = 100 * gpu_s / total
        data.append(
            {
                "type": "bar",
                "orientation": "h",
                "name": label,
                "y": ["allocation"],
                "x": [pct],
                "marker": {"color": color},
                "text": [f"{label} {pct:.0f}%" if pct >= 8 else ""],
                "textposition": "inside",
                "insidetextanchor": "middle",
                "textfont": {"color": "#fff"},
                "customdata": [[gpu_s / 3600]],
                "hovertemplate": (
                    f"{label}: %{{x:.1f}}% · %{{customdata[0]:.3f}} GPU-h<extra></extra>"
                ),
            }
        )
    return {"data": data, "layout": layout}
