"""The run overview, ``/runs/<name>``: one stacked figure on a shared x-axis, the run's
facts, its open alerts and its ranks' states.

The view (range of steps, step or time axis, a rank to draw) lives in the query string,
``?from=100&to=900&axis=time&rank=3``, so a link opens what its sender saw. A range
selected on the figure is read again from the collector at full detail (``from``/``to``,
at most :data:`POINTS` points a series, downsampled on the server so spikes survive).
Component ids start with ``run-``.
"""

from __future__ import annotations

import bisect
import datetime as dt
import logging
import math
import re
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal
from urllib.parse import parse_qs, quote, urlencode

import dash
from dash import Input, Output, State, dcc, html

from trainwarden.collector.read.queries import RUN_STATUS_HELP, NotFound

from ... import charts as figures
from ...client import Client
from ...components import (
    ago,
    is_default_pick,
    notice,
    parse_user,
    run_tabs,
    user_choices,
)
from ...first_graph import after_first
from ...gestures import hold_while_pointing
from ..alerts import panels as alerts
from ..hardware.panels import ACTION_TEXT, xid_rows
from ..ranks import collectives_panel as coll
from .figures import (
    REPLACED,
    Marker,
    Overview,
    RankLine,
    overview_figure,
    prepare,
    thin,
    user_figure,
)

log = logging.getLogger(__name__)
POINTS = 1_000  # per series: about one per pixel of a wide screen
METRICS = [
    "tokens_per_s",
    "mfu",
    "loss",
    "grad_norm",
    "step_time",
    "compute",
    "exposed_comm",
    "overlapped_comm",
    "data_wait",
]
LOSS_FLAGS = ("loss_spike", "nonfinite_loss")
SPIKE_FLAGS = (*LOSS_FLAGS, "grad_norm_spike", "nonfinite_grad_norm")
MAX_RANK_LINES = 3
AXES = ("step", "time")


# -- the view in the URL -----------------------------------------------------------


def parse_query(search: str | None) -> dict[str, Any]:
    """``?from=&to=&axis=&rank=`` as the view; what does not parse is left out."""
    q = parse_qs((search or "").lstrip("?"))

    def number(key: str) -> int | None:
        try:
            value = int(q[key][0])
        except (KeyError, ValueError):
            return None
        return value if value >= 0 else None

    lo, hi = number("from"), number("to")
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    axis = q.get("axis", ["step"])[0]
    return {
        "from": lo,
        "to": hi,
        "axis": axis if axis in AXES else "step",
        "rank": number("rank"),
        "user": parse_user(search),
    }


def to_query(view: dict[str, Any]) -> str:
    """The view as a query string (``""`` for the default view)."""
    items = [(k, view[k]) for k in ("from", "to") if view.get(k) is not None]
    if view.get("axis", "step") != "step":
        items.append(("axis", view["axis"]))
    if view.get("rank") is not None:
        items.append(("rank", view["rank"]))
    if view.get("user"):
        items.append(("user", view["user"].removeprefix("user.")))
    return "?" + urlencode(items) if items else ""


_RANGE_KEY = re.compile(r"xaxis\d*\.range(?:\[(\d)\])?$")


def range_from_relayout(
    relayout: dict[str, Any] | None, *, axis: str, xmap: dict[str, list[Any]] | None
) -> tuple[int, int] | None | Literal[False]:
    """The steps a zoom on the figure selected: ``(from, to)``; ``None`` for the whole
    run (a double-click autoscales); ``False`` when the event changed no x range."""
    if not relayout:
        return False
    if any(re.match(r"xaxis\d*\.autorange$", k) and v for k, v in relayout.items()):
        return None
    ends: dict[int, Any] = {}
    for key, value in relayout.items():
        found = _RANGE_KEY.match(key)
        if not found:
            continue
        if found.group(1) is None and isinstance(value, list) and len(value) == 2:
            ends = {0: value[0], 1: value[1]}
        else:
            ends[int(found.group(1))] = value
        if len(ends) == 2:
            break
    if len(ends) != 2:
        return False
    try:
        if axis == "time":
            t0, t1 = _timestamp(ends[0]), _timestamp(ends[1])
            steps, ts = (xmap or {}).get("step") or [], (xmap or {}).get("ts") or []
            if not steps:
                return False
            i = max(0, bisect.bisect_right(ts, t0) - 1)
            j = min(len(steps) - 1, bisect.bisect_left(ts, t1))
            lo, hi = steps[i], steps[j]
        else:
            lo, hi = math.floor(float(ends[0])), math.ceil(float(ends[1]))
    except (TypeError, ValueError, OverflowError):
        return False
    lo, hi = max(0, min(lo, hi)), max(0, max(lo, hi))
    return (lo, hi) if hi > lo else False


def _timestamp(value: Any) -> float:
    """A date on Plotly's time axis (``"2025-01-31 12:00:05.25"``, the server's local time)."""
    if isinstance(value, (int, float)):  # milliseconds since the epoch
        return float(value) / 1000.0
    text = str(value).replace("T", " ")
    whole, _, fraction = text.partition(".")
    parsed = dt.datetime.fromisoformat(whole)
    return parsed.timestamp() + (float(f"0.{fraction}") if fraction.isdigit() else 0.0)


# -- data ----------------------------------------------------------------------------


def _step_at(ts: float, steps: list[int], times: list[float]) -> int:
    """The step running at ``ts`` (the first or last one outside the run's span)."""
    i = bisect.bisect_right(times, ts) - 1
    return steps[max(0, min(i, len(steps) - 1))]


def markers(
    client: Client, name: str, *, steps: list[int], times: list[float], zoomed: bool
) -> list[Marker]:
    """Fired alerts, finished actions, checkpoints and restarts. A marker with no step of
    its own is placed at the step running at its time (or at the run's last step)."""
    found: list[Marker] = []
    for a in client.alerts(run=name, limit=500):
        if a.fired_at is None:
            continue
        where = f" rank {a.rank}" if a.rank is not None else ""
        tone = {"critical": "bad", "warning": "warn"}.get(a.severity, "info")
        found.append(
            Marker(
                "alert",
                a.fired_at,
                a.fired_at_step,  # None (an alert fired before 0019): the step running then
                f"alert {a.rule}{where} ({a.severity}, {a.state})",
                tone,
            )
        )
    for ac in client.actions(run=name, limit=200):
        if ac.state not in ("done", "failed"):
            continue
        why = f": {ac.reason}" if ac.reason else ""
        found.append(
            Marker(
                "action",
                ac.finished_at or ac.updated_at,
                None,
                f"action {ac.kind} {ac.state}{why}",
                "good" if ac.state == "done" else "bad",
            )
        )
    for c in client.checkpoints(name):
        found.append(
            Marker(
                "checkpoint",
                c.ts,
                c.step,
                f"checkpoint at step {c.step}: " + ("good" if c.good else f"suspect, {c.suspect}"),
                "good" if c.good else "warn",
            )
        )
    for e in client.events(name, kind="restart"):
        where = f"rank {e.rank} " if e.rank is not None else ""
        found.append(Marker("restart", e.ts, e.step, f"{where}restarted", "info"))
    placed = []
    for mk in found:
        if mk.step is None and steps:
            if zoomed and not times[0] <= mk.ts <= times[-1]:
                continue
            mk = Marker(mk.kind, mk.ts, _step_at(mk.ts, steps, times), mk.text, mk.tone)
        if zoomed and mk.step is not None and not steps[0] <= mk.step <= steps[-1]:
            continue
        placed.append(mk)
    return placed


def outlier_ranks(
    loss: Any, spikes: list[tuple[int, int, str, float | None]], *, wanted: int | None
) -> list[tuple[int, str]]:
    """Ranks worth a line of their own on the loss row, at most :data:`MAX_RANK_LINES`:
    the rank in the URL, ranks with loss spikes (most first), and a rank that holds the
    highest loss on most steps (with 3 ranks or more: with 2, one is always highest)."""
    picked: list[tuple[int, str]] = [(wanted, "selected")] if wanted is not None else []
    counts = Counter(rank for _, rank, flag, _ in spikes if flag in LOSS_FLAGS)
    for rank, n in counts.most_common():
        picked.append((rank, f"{n} loss spike{'s' if n != 1 else ''}"))
    if loss.step and max(loss.n, default=0) >= 3:
        top = Counter(r for r in loss.argmax_rank if r is not None).most_common(1)
        if top and top[0][1] >= 0.5 * len(loss.step):
            picked.append(
                (top[0][0], f"highest loss on {top[0][1] / len(loss.step):.0%} of points")
            )
    out: list[tuple[int, str]] = []
    for rank, why in picked:
        if all(rank != r for r, _ in out):
            out.append((rank, why))
    return out[:MAX_RANK_LINES]


def load(client: Client, name: str, view: dict[str, Any]) -> Overview:
    """Everything the figure draws, for the view's range (the whole run when none)."""
    lo, hi = view.get("from"), view.get("to")
    # The series queries run side by side (the database works, Python waits): a run of a
    # thousand ranks draws in about the time of its slowest query, not of their sum.
    futures = {
        m: _POOL.submit(client.series, name, m, points=POINTS, from_step=lo, to_step=hi)
        for m in METRICS
    }
    series = {m: f.result() for m, f in futures.items()}
    base = series["step_time"] if series["step_time"].step else series["loss"]
    spikes = [
        (f.step, f.rank, flag, f.loss if flag in LOSS_FLAGS else f.grad_norm)
        for f in client.flags(name)
        if (lo is None or f.step >= lo) and (hi is None or f.step <= hi)
        for flag in f.flags
        if flag in SPIKE_FLAGS
    ]
    lines = []
    for rank, why in outlier_ranks(series["loss"], spikes, wanted=view.get("rank")):
        rs = client.rank_series(name, rank, "loss", from_step=lo, to_step=hi)
        if rs.step:
            lines.append(RankLine(rank, why, *thin(rs.step, rs.ts, rs.value, POINTS)))
    zoomed = lo is not None or hi is not None
    found = markers(client, name, steps=list(base.step), times=list(base.ts), zoomed=zoomed)
    replaced = {
        m: client.replaced(name, m, points=POINTS, from_step=lo, to_step=hi) for m in REPLACED
    }
    return Overview(
        series=series,
        spikes=spikes,
        ranks=lines,
        markers=found,
        replaced={m: r for m, r in replaced.items() if r.step},
    )


def range_label(data: Overview, view: dict[str, Any]) -> str:
    base = data.series.get("step_time")
    if base is None or not base.step:
        return ""
    per = f" · 1 point = {base.bucket} steps" if base.bucket > 1 else ""
    if view.get("from") is None and view.get("to") is None:
        return f"Whole run: steps {base.step[0]:,}–{base.step[-1]:,}{per} · live"
    first = view.get("from") or 0
    last = view["to"] if view.get("to") is not None else base.step[-1]
    return f"Steps {first:,}–{last:,}{per}"


# -- the header, alerts and ranks panels ---------------------------------------------

HEALTH_EVENTS = {"rank_state", "xid", "drill", "loss_divergence", "restart", "rank_conflict"}


def _event_text(e: Any) -> str:
    d = e.data or {}
    if e.kind == "rank_state":
        return f"{d.get('from')} → {d.get('to')}" + (f": {d['reason']}" if d.get("reason") else "")
    if e.kind == "xid":  # the catalog's words when the event has the code alone
        (x,) = xid_rows([e], [])
        code = "?" if x.code is None else x.code
        return f"XID {code} {x.name}: {x.meaning} Action: {ACTION_TEXT.get(x.action, x.action)}."
    if e.kind == "drill":
        return f"drill injected: {d.get('spec') or d.get('fault')}"
    if e.kind == "loss_divergence":
        return f"loss diverges from peers (robust z {d.get('robust_z')}): {d.get('reason', '')}"
    if e.kind == "rank_conflict":  # which processes collide: pid, node, session of each
        return f"duplicate rank: {d.get('reason', '')}"
    return e.kind


_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="trainwarden-ui-query")
PANEL_RANKS = 32  # the overview lists every rank up to this; past it, those in trouble
QUIET = ("healthy", "running", "finished")


def ranks_panel(run: Any, gpu: list[Any], events: list[Any]) -> html.Div:
    """Rank states (culprits and victims say so), GPUs, and the latest health events."""
    latest: dict[int, Any] = {}
    for sample in gpu:
        latest[sample.rank] = sample
    rows = []
    listed = list(run.ranks)
    if len(listed) > PANEL_RANKS:  # a table of thousands of rows takes the browser minutes
        listed = [r for r in listed if r.state not in QUIET][:PANEL_RANKS]
    for r in listed:
        detail = r.state_detail or {}
        role = f"{detail['role']}: " if detail.get("role") else ""
        sample = latest.get(r.rank)
        if sample is not None:
            throttle = f" · {', '.join(sample.throttle)}" if sample.throttle else ""
            sim = " (simulated)" if sample.simulated else ""
            gpu_text = (
                f"{sample.temp_c:.0f} °C{throttle}{sim}"
                if sample.temp_c is not None
                else sample.gpu_name
            )
        elif r.gpu and r.gpu.get("state") == "unavailable":
            gpu_text = "no GPU telemetry"
        else:
            gpu_text = "—"
        rows.append(
            html.Tr(
                [
                    html.Td(r.rank),
                    html.Td(r.node or r.host),
                    html.Td(html.Span(r.state, className=f"status status-{r.state}")),
                    html.Td(role + detail.get("reason", ""), className="detail"),
                    html.Td("—" if r.last_step is None else r.last_step),
                    html.Td(gpu_text),
                ]
            )
        )
    table = html.Table(
        [
            html.Thead(
                html.Tr([html.Th(h) for h in ("Rank", "Node", "State", "Why", "Step", "GPU")])
            ),
            html.Tbody(rows),
        ],
        className="runs-table ranks-table",
    )
    recent = [e for e in events if e.kind in HEALTH_EVENTS][-8:]
    items = [
        html.Li(
            [
                html.Span(
                    dt.datetime.fromtimestamp(e.ts).strftime("%H:%M:%S"), className="fact-key"
                ),
                html.Span(f"rank {e.rank} " if e.rank is not None else ""),
                html.Span(_event_text(e), className=f"sev-{e.severity}"),
            ]
        )
        for e in reversed(recent)
    ]
    counts: dict[str, int] = {}
    for r in run.ranks:
        counts[r.state] = counts.get(r.state, 0) + 1
    summary = None
    if len(listed) < len(run.ranks):
        chips = [
            html.Span(f"{n} {state}", className=f"status status-{state}")
            for state, n in sorted(counts.items())
        ]
        link = dcc.Link(
            "every rank: the Ranks page", href=f"/runs/{quote(run.name, safe='')}/ranks"
        )
        summary = html.P(
            [
                *chips,
                f" — {len(listed)} of {len(run.ranks)} ranks listed (those in trouble); ",
                link,
            ],
            className="hint state-chips",
        )
    return html.Div(
        [summary, table if rows else None, html.Ul(items, className="events") if items else None],
        className="ranks-panel",
    )


def run_header(run: Any) -> Any:
    facts = [
        (
            "status",
            html.Span(
                run.status,
                className=f"status status-{run.status}",
                title=RUN_STATUS_HELP.get(run.status, ""),
            ),
        ),
        ("ranks", f"{run.ranks_seen} / {run.world_size}"),
        ("step", "—" if run.last_step is None else str(run.last_step)),
        ("updated", ago(run.updated_at)),
    ]
    return html.Div(
        [
            html.H2(run.name),
            html.Div(
                [
                    html.Span([html.Span(k, className="fact-key"), v], className="fact")  # type: ignore[list-item]
                    for k, v in facts
                ],
                className="facts",
            ),
        ]
    )


def run_alerts(client: Client, name: str) -> Any:
    """The run's open alerts; an error here leaves the rest of the run page alone."""
    try:
        found = client.alerts(run=name, states=alerts.OPEN, limit=20)
    except Exception as exc:
        log.exception("run page alerts %s", name)
        return notice(
            f"Cannot read this run's alerts: {exc.__class__.__name__}. Retrying.", "error"
        )
    return alerts.run_alerts_panel(found, run=name, now=time.time())


def hang_banner(client: Client, run: Any) -> Any:
    """One line at the top while ranks are hung and the collector names the rank they
    wait on (or a desync), linking to the ranks page's Collectives section.

    Shown while the health evaluator holds a rank hung, not while the verdict is newer
    than the last step: the hung state clears by itself when steps complete again, and
    it compares no rank's clock with the collector's. A run with no hung rank costs no
    query. An error here leaves the rest of the page alone."""
    hung = sum(1 for r in run.ranks if r.state == "hung")
    if not hung:  # a job that died in a collective: the same story, and how it ended
        return coll.lost_banner(run)
    try:
        view = client.collectives(run.name)
    except Exception:
        log.exception("run page collectives %s", run.name)
        return None
    return coll.banner(view, run=run.name, hung=hung)


# -- page ----------------------------------------------------------------------------


USER_HINT = (
    "No metrics of your own in this run: log them inside the step with "
    "s.metric(name, value) (a learning rate, an eval loss, an MoE aux loss)."
)


def user_part(
    client: Client, name: str, view: dict[str, Any], metric: str | None, theme: str | None
) -> Any:
    """The picked user metric (else the run's first) across ranks, over the view's range."""
    if not metric:
        found = client.user_metrics(name)
        if not found:
            return figures.themed(figures.empty_figure(USER_HINT), theme)
        metric = found[0]
    axis = view.get("axis", "step")
    series = client.series(
        name, metric, points=POINTS, from_step=view.get("from"), to_step=view.get("to")
    )
    return user_figure(series, axis=axis, theme=theme, revision=f"{name}|{axis}|{metric}")


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    view = parse_query(search)
    toolbar = html.Div(
        [
            dcc.RadioItems(
                id="run-axis",
                options=[{"label": " step", "value": "step"}, {"label": " time", "value": "time"}],
                value=view["axis"],
                inline=True,
                className="run-axis",
            ),
            html.Label(
                [
                    "rank ",
                    dcc.Input(
                        id="run-rank",
                        type="number",
                        min=0,
                        step=1,
                        value=view["rank"],
                        debounce=True,
                        placeholder="all",
                        className="run-rank",
                    ),
                ],
                title="Draw one rank's loss over the band",
            ),
            html.Button(
                "Whole run",
                id="run-reset",
                className="btn btn-small",
                title="Show every step (or double-click the plot)",
            ),
            html.Span(id="run-range", className="hint run-range"),
        ],
        className="run-toolbar",
    )
    return html.Div(
        [
            # The query string as the browser has it: the view is drawn from it already, and
            # the figure's first callback does not wait on a sync() that would change nothing.
            dcc.Location(id="run-url", refresh=False, search=search),
            dcc.Store(id="run-name", data=name),
            dcc.Store(id="run-view", data=view),
            dcc.Store(id="run-xmap"),
            dcc.Store(id="run-drag"),  # the newest drag (x range) on the chart: see sync
            dcc.Store(id="run-tick"),  # the refresh ticks the charts take: see gestures
            dcc.Store(id="run-drawn"),  # set once the chart's first figure is back
            html.Div(id="run-header", children=html.H2(name)),
            run_tabs(name, "Overview"),
            html.Div(id="run-notice"),
            html.Div(id="run-alerts"),
            toolbar,
            dcc.Graph(
                id="run-overview",
                figure=figures.placeholder("Loading…"),
                config={"displaylogo": False, "doubleClick": "autosize"},
            ),
            html.Div(
                [
                    html.Span("Your metric ", className="fact-key"),
                    # RadioItems, not a Dropdown: dcc's Dropdown is a chunk loaded on demand, and
                    # loading it slowed the overview's first drawing.
                    dcc.RadioItems(
                        id="run-user-metric", options=[], inline=True, className="user-pick"
                    ),
                ],
                className="run-user-pick",
                style={"margin": "0.5rem 0"},
            ),
            dcc.Graph(
                id="run-user",
                figure=figures.placeholder("Loading…"),
                config={"displaylogo": False},
            ),
            html.Div(id="run-ranks"),
            dcc.Interval(id="run-interval", interval=int(refresh_s * 1000)),
        ]
    )


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks."""
    prepare()

    @app.callback(
        Output("run-header", "children"),
        Output("run-notice", "children"),
        Output("run-alerts", "children"),
        Output("run-ranks", "children"),
        Input("run-interval", "n_intervals"),
        Input("run-drawn", "data"),  # the first call, once the chart's figure is back
        State("run-name", "data"),
        prevent_initial_call=True,  # (see first_graph)
    )
    def refresh_run(_n: int | None, _drawn: bool | None, name: str) -> Any:
        try:
            run = client.get_run(name)
            panel = ranks_panel(run, client.gpu(name, since=time.time() - 120), client.events(name))
            return run_header(run), hang_banner(client, run), run_alerts(client, name), panel
        except NotFound:
            message = (
                f"Run {name!r} not found. It appears once its first agent reports; "
                "check the run name, or pick a run from the runs list."
            )
            return html.H2(name), notice(message, "error"), None, None
        except Exception as exc:
            log.exception("run page %s", name)
            message = f"Cannot read run data: {exc.__class__.__name__}. Retrying every few seconds."
            return dash.no_update, notice(message, "error"), dash.no_update, dash.no_update

    @app.callback(
        Output("run-overview", "figure"),
        Output("run-xmap", "data"),
        Output("run-range", "children"),
        Input("run-tick", "data"),  # the interval's, held while a pointer is down on a chart
        Input("run-view", "data"),
        Input("theme", "data"),
        State("run-name", "data"),
    )
    def draw(_n: int | None, view: dict[str, Any], theme: str | None, name: str) -> Any:
        axis = view.get("axis", "step")
        try:
            data = load(client, name, view)
        except NotFound:
            fig = figures.empty_figure(f"Run {name!r} not found")
            return figures.themed(fig, theme), None, ""
        except Exception as exc:  # the last drawn figure stays; the header says what is wrong
            log.exception("run overview %s", name)
            return (
                dash.no_update,
                dash.no_update,
                f"Cannot read data ({exc.__class__.__name__}); retrying.",
            )
        base = data.series["step_time"]
        lo, hi = view.get("from"), view.get("to")
        x_range = None
        if (lo is not None or hi is not None) and base.step:
            x_range = (base.step[0] if lo is None else lo, base.step[-1] if hi is None else hi)
        fig = overview_figure(
            data, axis=axis, theme=theme, revision=f"{name}|{axis}", x_range=x_range
        )
        return fig, {"step": base.step, "ts": base.ts}, range_label(data, view)

    @app.callback(
        Output("run-user-metric", "options"),
        Output("run-user-metric", "value"),
        Input("run-xmap", "data"),
        State("run-view", "data"),
        State("run-name", "data"),
        State("run-user-metric", "options"),
        State("run-user-metric", "value"),
    )
    def pick_user(
        _drawn: Any,
        view: dict[str, Any],
        name: str,
        shown: list[dict[str, str]] | None,
        value: str | None,
    ) -> Any:
        """The run's own metrics, refreshed after each drawing of the overview (so that
        they do not compete with it while the page loads); the value is set only while
        the picker has none the run offers (the URL's pick, else the first metric): a
        refresh called between a click and ``sync``'s record of it in the view would
        otherwise put the old pick back (a browser test lost the click that way). The
        URL's pick on back / forward is ``sync``'s to set.

        Only what changed is set: setting the picker's value fires ``sync``, and a
        refresh that called it while a zoom's call was in flight made Dash drop the
        zoom's answer (its duplicate pruning), so that a drag was sometimes lost."""
        try:
            options, pick = user_choices(client, name, view.get("user"))
        except Exception:  # the page's notice says what is wrong
            return dash.no_update, dash.no_update
        offered = {o["value"] for o in options}
        return (
            options if options != shown else dash.no_update,
            pick if value not in offered and pick != value else dash.no_update,
        )

    @app.callback(
        Output("run-user", "figure"),
        Input("run-xmap", "data"),
        Input("run-user-metric", "value"),
        State("run-view", "data"),
        State("theme", "data"),
        State("run-name", "data"),
    )
    def draw_user(
        _drawn: Any, metric: str | None, view: dict[str, Any], theme: str | None, name: str
    ) -> Any:
        try:
            return user_part(client, name, view, metric or view.get("user"), theme)
        except NotFound:
            return figures.themed(figures.empty_figure(f"Run {name!r} not found"), theme)
        except Exception:  # the last drawn figure stays
            log.exception("run page user metric %s", name)
            return dash.no_update

    hold_while_pointing(app, "run-interval", "run-tick")
    after_first(app, ("run-range", "children"), "run-drawn")  # set by every draw()

    # A drag (or a double click) on the chart, numbered, into a store, in the browser:
    # only relayouts that set an x range, so that a refresh's redraw (its relayout holds
    # none) never calls sync. sync applies the newest drag whatever input fired it: when
    # Dash drops an answer of sync for a newer call (it does, for the same callback), the
    # newer call still applies the drag (a single drag right after the first draw was
    # lost that way in loaded CI runs).
    app.clientside_callback(
        """function(relayout) {
            const ranged = relayout && Object.keys(relayout).some(
                k => /^xaxis\\d*\\.(range(\\[\\d\\])?|autorange)$/.test(k));
            if (!ranged) { return window.dash_clientside.no_update; }
            window._twDrags = (window._twDrags || 0) + 1;
            return {n: window._twDrags, relayout: relayout};
        }""",
        Output("run-drag", "data"),
        Input("run-overview", "relayoutData"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output("run-url", "search"),
        Output("run-view", "data"),
        Output("run-axis", "value"),
        Output("run-rank", "value"),
        Output("run-user-metric", "value", allow_duplicate=True),
        Input("run-url", "search"),
        Input("run-drag", "data"),
        Input("run-axis", "value"),
        Input("run-rank", "value"),
        Input("run-reset", "n_clicks"),
        Input("run-user-metric", "value"),
        State("run-user-metric", "options"),
        State("run-view", "data"),
        State("run-xmap", "data"),
        prevent_initial_call=True,
    )
    def sync(
        search: str | None,
        drag: dict[str, Any] | None,
        axis: str | None,
        rank: Any,
        _reset: int | None,
        user: str | None,
        options: list[dict[str, str]] | None,
        view: dict[str, Any],
        xmap: dict[str, list[Any]] | None,
    ) -> Any:
        keep = dash.no_update
        # Every input that fired: Dash sends those that changed together in one call, in
        # no set order (a pick and a refresh's relayout of the chart can come together).
        fired = [t["prop_id"].rpartition(".")[0] for t in dash.ctx.triggered]
        if "run-url" in fired:  # opened, or back / forward in the browser
            want = parse_query(search)
            if drag:  # a drag made before is the page's past, not a new one
                want["drag"] = drag.get("n")
            shown = None
            # The picker is set only by a navigation that changes the pick: a URL written
            # by a drag (or the page's own) leaves it to pick_user, whose first answer may
            # be on its way, and setting it here too made one more call race the drag's.
            if want.get("user") != view.get("user"):
                offered = [o["value"] for o in options or ()]
                shown = want.get("user") if want.get("user") in offered else None
                shown = shown or (offered[0] if offered else None)  # no pick: the first
            return (
                keep,
                want if want != view else keep,
                want["axis"] if want["axis"] != axis else keep,
                want["rank"] if want["rank"] != rank else keep,
                shown if shown is not None and shown != user else keep,
            )
        want = dict(view)
        if drag and drag.get("n") != view.get("drag"):  # a drag not applied yet
            want["drag"] = drag.get("n")
            picked = range_from_relayout(
                drag.get("relayout"), axis=view.get("axis", "step"), xmap=xmap
            )
            if picked is not False:
                want["from"], want["to"] = picked if picked is not None else (None, None)
        for trigger in fired:
            if trigger == "run-axis":
                want["axis"] = axis if axis in AXES else "step"
            elif trigger == "run-rank":
                want["rank"] = int(rank) if isinstance(rank, (int, float)) and rank >= 0 else None
            elif trigger == "run-reset":
                want["from"] = want["to"] = None
            elif (
                trigger == "run-user-metric"
                and user
                and not is_default_pick(user, options, view.get("user"))
            ):  # a pick (a refresh setting the default is none)
                want["user"] = user
        if want == view:
            return keep, keep, keep, keep, keep
        # "?" for the default view: an empty search would leave the old one in the address bar.
        query = to_query(want) or "?"
        return (query if query != (search or "?") else keep), want, keep, keep, keep
