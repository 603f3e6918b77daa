"""The run page's Data section: what the run trained on, as pure functions of the
collector's answer (``GET /api/v1/runs/{run}/data``, ``read.data.view``).

- each judged epoch: samples seen and distinct of the dataset, repeated, missing (exact,
  or ``≈ n ± error`` when counted on a sample of a large dataset), the first step that
  repeated a sample, and examples (ids, and where each repeat was trained on);
- the realized data mixture against the declared one, as grouped bars by source;
- the newest data events (repeated batches, data order drift, epochs past the
  allowance, mixture drift).

A run that reports none of it gets one quiet line saying what to add.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dash import dcc, html

from .figures import INK
from .panels import MISSING

NOTHING = (
    "No data checks for this run. For epoch coverage pass tw.init(dataset_size=N) and "
    "call s.samples(ids) each step, or wrap the loader: tw.watch_loader(loader); for the "
    "mixture pass tw.init(data_mixture={...}) and call s.data_source(name, tokens)."
)
NO_COVERAGE = (
    "No epoch counted yet: an epoch is counted once every rank ended it, with "
    "tw.init(dataset_size=N) and s.samples(ids), or tw.watch_loader(loader)."
)
NO_MIXTURE = (
    "No data mixture: declare it with tw.init(data_mixture={...}) and report each "
    "step's tokens by source with s.data_source(name, tokens)."
)
NO_EVENTS = "No data events: no repeated batch, order drift, epoch or mixture past its allowance."
DECLARED_COLOR = "#9ca3af"
REALIZED_COLOR = "#2563eb"
SHOWN_EXAMPLES = 3  # in the cell; all of them (up to 10) on hover


def count(n: int | None, error: float, exact: bool) -> str:
    """``12``, or ``≈ 1,200 ± 35`` when estimated from a sample."""
    if n is None:
        return MISSING
    return f"{n:,}" if exact else f"≈ {n:,} ± {error:,.0f}"


def _where(at: Sequence[Sequence[int]]) -> str:
    return ", ".join(f"step {step} rank {rank}" for step, rank in at)


def examples_text(c: dict[str, Any], *, shown: int | None = SHOWN_EXAMPLES) -> str:
    """``repeated: id 17 (step 3 rank 0, step 9 rank 1) · missing: 4, 5``."""
    parts = []
    dups = c.get("duplicate_examples") or []
    if dups:
        named = [f"id {d['id']} ({_where(d['at'])})" for d in dups[:shown]]
        more = len(dups) - len(named)
        parts.append("repeated: " + "; ".join(named) + (f"; … {more} more" if more else ""))
    missing = c.get("missing_examples") or []
    if missing:
        listed = [str(i) for i in missing[:shown]]
        more = len(missing) - len(listed)
        parts.append("missing: " + ", ".join(listed) + (f", … {more} more" if more else ""))
    return " · ".join(parts) or MISSING


def _flagged(text: str, past: bool, what: str, allowance: float | None) -> html.Td:
    if not past:
        return html.Td(text)
    allowed = "" if allowance is None else f" of {allowance:,.0f}"
    return html.Td(
        f"{text} ⚠", className="sev-warning", title=f"{what} past the allowance{allowed}"
    )


def coverage_table(epochs: Sequence[dict[str, Any]]) -> Any:
    """One row per judged epoch, newest first."""
    if not epochs:
        return html.P(NO_COVERAGE, className="hint")
    header = ("Epoch", "Steps", "Samples", "Repeated", "Missing", "Counted", "First repeat")
    rows = []
    for c in epochs:
        exact = bool(c["exact"])
        steps = c.get("steps")
        first = c.get("first_duplicate_step")
        rows.append(
            html.Tr(
                [
                    html.Td(str(c["epoch"])),
                    html.Td(MISSING if not steps else f"{steps[0]} → {steps[1]}"),
                    html.Td(
                        f"{c['seen']:,} seen · {c['distinct']:,} distinct of {c['dataset_size']:,}"
                    ),
                    _flagged(
                        count(c["duplicated"], c.get("duplicated_error") or 0.0, exact),
                        bool(c.get("duplicated_past")),
                        "repeats",
                        c.get("allowance"),
                    ),
                    _flagged(
                        count(c["missing"], c.get("missing_error") or 0.0, exact),
                        bool(c.get("skipped_past")),
                        "missing samples",
                        c.get("missing_allowance", c.get("allowance")),
                    ),
                    html.Td("exact" if exact else f"on a sample of {c['kept']:,}"),
                    html.Td(MISSING if first is None else str(first)),
                    html.Td(
                        examples_text(c),
                        className="detail",
                        title=examples_text(c, shown=None),
                    ),
                ],
                id=f"ri-epoch-{c['epoch']}",
                className="ri-epoch",
            )
        )
    return html.Table(
        [
            html.Thead(html.Tr([*(html.Th(h) for h in header), html.Th("Examples")])),
            html.Tbody(rows),
        ],
        className="runs-table ri-coverage",
    )


def sources(mix: dict[str, Any]) -> list[str]:
    """The declared sources in their order, then the undeclared ones the run drew from."""
    declared = list(mix.get("declared") or {})
    return declared + sorted(s for s in mix.get("realized") or {} if s not in declared)


UNDECLARED = 0.01
"""How far a source the mixture does not declare may go (read/mixture.py's tolerance(0))."""


def off_tolerance(mix: dict[str, Any]) -> list[str]:
    """``code: 40.0% realized, 30.0% declared`` for each source past the tolerance."""
    declared, real = mix.get("declared"), mix.get("realized") or {}
    if not declared or not real:
        return []
    allowed = mix.get("tolerance") or {}
    return [
        f"{s}: {real.get(s, 0.0):.1%} realized, {declared.get(s, 0.0):.1%} declared"
        for s in sources(mix)
        if abs(real.get(s, 0.0) - declared.get(s, 0.0)) > float(allowed.get(s, UNDECLARED))
    ]


def mixture_figure(mix: dict[str, Any], *, theme: str | None, revision: str) -> dict[str, Any]:
    """Declared and realized share of each source, side by side, in percent."""
    ink, grid = INK.get(theme or "light", INK["light"])
    names = sources(mix)
    declared, real, tokens = mix.get("declared"), mix.get("realized") or {}, mix.get("tokens") or {}
    data: list[dict[str, Any]] = []
    if declared:
        data.append(
            {
                "type": "bar",
                "name": "declared",
                "x": names,
                "y": [100 * declared.get(s, 0.0) for s in names],
                "marker": {"color": DECLARED_COLOR},
                "hovertemplate": "%{x} declared: %{y:.1f}%<extra></extra>",
            }
        )
    if real:
        data.append(
            {
                "type": "bar",
                "name": "realized",
                "x": names,
                "y": [100 * real.get(s, 0.0) for s in names],
                "customdata": [tokens.get(s, 0) for s in names],
                "marker": {"color": REALIZED_COLOR},
                "hovertemplate": "%{x} realized: %{y:.1f}% · %{customdata:,} tokens<extra></extra>",
            }
        )
    layout = {
        "barmode": "group",
        "height": 220,
        "margin": {"l": 40, "r": 10, "t": 10, "b": 30},
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"color": ink, "size": 12},
        "uirevision": revision,
        "legend": {"orientation": "h", "y": 1.12, "x": 0},
        "xaxis": {"fixedrange": True},
        "yaxis": {"ticksuffix": "%", "gridcolor": grid, "rangemode": "tozero", "fixedrange": True},
    }
    return {"data": data, "layout": layout}


def mixture_part(mix: dict[str, Any], *, theme: str | None, revision: str) -> Any:
    """The bars with a line saying over which steps; the hint when there is no mixture."""
    declared, real = mix.get("declared"), mix.get("realized") or {}
    if not declared and not real:
        return html.P(NO_MIXTURE, className="hint")
    window = mix.get("window")
    if real and window:
        said = (
            f"Realized over steps {window[0]}–{window[1]} ({mix.get('steps', 0):,} steps "
            "reported sources); a source may be off its weight by a fifth of it, at least "
            "1 point."
        )
    else:
        said = "No step reported its sources yet: call s.data_source(name, tokens)."
    if not declared:
        said += " No declared mixture to compare with: tw.init(data_mixture={...})."
    off = off_tolerance(mix)
    return html.Div(
        [
            html.P(said, className="hint"),
            dcc.Graph(
                id="ri-mixture",
                figure=mixture_figure(mix, theme=theme, revision=revision),
                config={"displaylogo": False, "displayModeBar": False},
            ),
            *(
                [html.P("Past the tolerance: " + "; ".join(off), className="sev-warning")]
                if off
                else []
            ),
        ]
    )


def events_table(events: Sequence[dict[str, Any]]) -> Any:
    """The newest data events, newest first: step, kind, reason."""
    if not events:
        return html.P(NO_EVENTS, className="hint")
    return html.Table(
        [
            html.Thead(html.Tr([html.Th("Step"), html.Th("Kind"), html.Th("Reason")])),
            html.Tbody(
                [
                    html.Tr(
                        [
                            html.Td(MISSING if e.get("step") is None else str(e["step"])),
                            html.Td(e["kind"], className=f"sev-{e.get('severity') or 'info'}"),
                            html.Td(e.get("reason") or ""),
                        ],
                        className="ri-data-event",
                    )
                    for e in events
                ]
            ),
        ],
        className="runs-table ri-data-events",
    )


def section(view: dict[str, Any] | None, *, theme: str | None, revision: str = "") -> Any:
    """The Data section of the run page; one quiet line when the run reports none of it."""
    view = view or {}
    epochs = view.get("coverage") or []
    mix = view.get("mixture") or {}
    events = view.get("events") or []
    if not epochs and not events and not mix.get("declared") and not mix.get("realized"):
        return html.P(NOTHING, className="hint")
    return html.Div(
        [
            html.H4("Epoch coverage"),
            coverage_table(epochs),
            html.H4("Mixture: realized against declared"),
            mixture_part(mix, theme=theme, revision=revision),
            html.H4("Data events"),
            events_table(events),
        ],
        className="ri-data",
    )
