"""The Dash app: a runs list at ``/``, a live run page at ``/runs/<name>`` and the alerts
page at ``/alerts`` (:mod:`.alerts_page`).

Pages are small layouts plus one callback each; component ids carry the page prefix
(``runs-``, ``run-``, ``alerts-``); figures come from :mod:`.figures`. A data error shows as a
message in the page, never as a traceback.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import time
from typing import Any
from urllib.parse import quote, unquote

import dash
from dash import Input, Output, State, dcc, html

from trainwarden.collector.queries import NotFound

from . import alerts, alerts_page, figures, hardware_page, ranks_page
from .client import Client
from .components import ago, notice, run_tabs

log = logging.getLogger(__name__)
ASSETS = os.path.join(os.path.dirname(__file__), "assets")
LIVE_WINDOW_STEPS = 5_000  # the run page draws the newest steps; older ones by zooming (issue 8)


# -- pages -----------------------------------------------------------------------


def runs_layout() -> html.Div:
    return html.Div(
        [
            html.H2("Runs"),
            html.Div(id="runs-table", children=notice("Loading runs…")),
            dcc.Interval(id="runs-interval", interval=5_000),
        ]
    )


def runs_table(client: Client) -> Any:
    runs = client.list_runs()
    if not runs:
        return notice(
            "No runs yet. Add the agent to a trainer (tw.init(run=..., url=...)) "
            "or start `trainwarden demo`; runs appear here within seconds."
        )
    firing: dict[str, int] = {}
    for a in client.alerts(states=["firing"], limit=10_000):
        firing[a.run] = firing.get(a.run, 0) + 1
    header = html.Tr(
        [
            html.Th(h)
            for h in (
                "Run",
                "Status",
                "Firing alerts",
                "World size",
                "Ranks seen",
                "Last step",
                "Updated",
            )
        ]  # fmt: skip
    )
    rows = [
        html.Tr(
            [
                html.Td(dcc.Link(r.name, href=f"/runs/{r.name}", className="run-link")),
                html.Td(html.Span(r.status, className=f"status status-{r.status}")),
                html.Td(
                    dcc.Link(
                        str(firing[r.name]),
                        href=f"/alerts?run={quote(r.name)}&state=firing",
                        className="firing-count",
                    )
                    if r.name in firing
                    else "—"
                ),  # fmt: skip
                html.Td(r.world_size),
                html.Td(r.ranks_seen),
                html.Td("—" if r.last_step is None else r.last_step),
                html.Td(ago(r.updated_at)),
            ]
        )
        for r in runs
    ]
    return html.Table([html.Thead(header), html.Tbody(rows)], className="runs-table")


RUN_GRAPHS = ["loss", "breakdown", "mfu", "throughput", "grad-norm", "step-time"]
BREAKDOWN_METRICS = [
    "step_time", "data_wait", "compute", "overlapped_comm", "exposed_comm", "idle",
    "forward", "backward", "optimizer", "other",
]  # fmt: skip


def run_layout(name: str, *, refresh_s: float) -> html.Div:
    graph = {"config": {"displaylogo": False}, "figure": figures.empty_figure("Loading…")}
    return html.Div(
        [
            dcc.Store(id="run-name", data=name),
            html.Div(id="run-header", children=html.H2(name)),
            run_tabs(name, "Overview"),
            html.Div(id="run-notice"),
            html.Div(id="run-alerts"),
            html.Div(id="run-ranks"),
            *[dcc.Graph(id=f"run-{g}", **graph) for g in RUN_GRAPHS],
            dcc.Interval(id="run-interval", interval=int(refresh_s * 1000)),
        ]
    )


def run_figures(client: Client, name: str) -> list[Any]:
    """The run page's figures, in RUN_GRAPHS order."""
    window = LIVE_WINDOW_STEPS

    def series(metric: str) -> Any:
        return client.series(name, metric, last=window)

    spikes = [(f.step, f.rank, flag) for f in client.flags(name) for flag in f.flags]
    loss_spikes = [s for s in spikes if s[2] in ("loss_spike", "nonfinite_loss")]
    grad_spikes = [s for s in spikes if s[2] != "loss_spike" and s[2] != "nonfinite_loss"]
    return [
        figures.band_figure(series("loss"), title="Loss", revision=name, spikes=loss_spikes),
        figures.breakdown_figure({m: series(m) for m in BREAKDOWN_METRICS}, revision=name),
        figures.band_figure(series("mfu"), title="MFU", revision=name),
        figures.total_figure(series("tokens_per_s"), title="Throughput (tokens/s)", revision=name),
        figures.band_figure(
            series("grad_norm"), title="Grad norm", revision=name, spikes=grad_spikes
        ),
        figures.band_figure(series("step_time"), title="Step time", revision=name),
    ]


HEALTH_EVENTS = {"rank_state", "xid", "drill", "loss_divergence", "restart"}


def _event_text(e: Any) -> str:
    d = e.data or {}
    if e.kind == "rank_state":
        return f"{d.get('from')} → {d.get('to')}" + (f": {d['reason']}" if d.get("reason") else "")
    if e.kind == "xid":
        return f"XID {d.get('code')} {d.get('name', '')}: {d.get('meaning', '')} Action: {d.get('action')}"
    if e.kind == "drill":
        return f"drill injected: {d.get('spec') or d.get('fault')}"
    if e.kind == "loss_divergence":
        return f"loss diverges from peers (robust z {d.get('robust_z')}): {d.get('reason', '')}"
    return e.kind


def ranks_panel(run: Any, gpu: list[Any], events: list[Any]) -> html.Div:
    """Rank states (culprits and victims say so), GPUs, and the latest health events."""
    latest: dict[int, Any] = {}
    for sample in gpu:
        latest[sample.rank] = sample
    rows = []
    for r in run.ranks:
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
        rows.append(html.Tr([
            html.Td(r.rank), html.Td(r.node or r.host),
            html.Td(html.Span(r.state, className=f"status status-{r.state}")),
            html.Td(role + detail.get("reason", ""), className="detail"),
            html.Td("—" if r.last_step is None else r.last_step), html.Td(gpu_text),
        ]))  # fmt: skip
    table = html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in ("Rank", "Node", "State", "Why", "Step", "GPU")])),
         html.Tbody(rows)],
        className="runs-table ranks-table",
    )  # fmt: skip
    recent = [e for e in events if e.kind in HEALTH_EVENTS][-8:]
    items = [
        html.Li([html.Span(dt.datetime.fromtimestamp(e.ts).strftime("%H:%M:%S"), className="fact-key"),
                 html.Span(f"rank {e.rank} " if e.rank is not None else ""),
                 html.Span(_event_text(e), className=f"sev-{e.severity}")])
        for e in reversed(recent)
    ]  # fmt: skip
    return html.Div(
        [table, html.Ul(items, className="events") if items else None], className="ranks-panel"
    )


def run_header(client: Client, name: str) -> Any:
    run = client.get_run(name)
    facts = [
        ("status", html.Span(run.status, className=f"status status-{run.status}")),
        ("ranks", f"{run.ranks_seen} / {run.world_size}"),
        ("step", "—" if run.last_step is None else str(run.last_step)),
        ("updated", ago(run.updated_at)),
    ]
    return html.Div(
        [
            html.H2(name),
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


def _run_names(client: Client) -> list[str]:
    try:
        return [r.name for r in client.list_runs()]
    except Exception:  # the page's own refresh says what is wrong
        log.exception("alerts page: run names")
        return []


# -- app -------------------------------------------------------------------------


def create_dash(client: Client, *, refresh_s: float = 2.0) -> dash.Dash:
    """The UI on ``client``; mount ``app.server`` (a Flask WSGI app) at ``/``."""
    app = dash.Dash(
        __name__,
        title="trainwarden",
        assets_folder=ASSETS,
        suppress_callback_exceptions=True,  # page components appear after routing
        update_title=None,  # type: ignore[arg-type]  # None: no "Updating..." tab title
    )
    app.layout = html.Div(
        [
            dcc.Location(id="url"),
            # "light" or "dark", kept in the browser; figures take it as an Input.
            dcc.Store(id="theme", storage_type="local", data="light"),
            html.Header(
                [
                    dcc.Link("trainwarden", href="/", className="brand"),
                    dcc.Link("Runs", href="/", className="nav"),
                    dcc.Link("Alerts", href="/alerts", className="nav"),
                    html.A("Runbooks", href="/runbooks", className="nav"),
                    html.Button(
                        "◐ Theme", id="theme-toggle", className="theme-toggle", title="Light / dark"
                    ),
                ],
                className="topbar",
            ),
            html.Main(id="page", className="page"),
            dcc.Store(id="page-path"),
        ]
    )

    @app.callback(
        Output("page", "children"),
        Output("page-path", "data"),
        Input("url", "pathname"),
        State("url", "search"),
        State("page-path", "data"),
    )
    def route(pathname: str | None, search: str | None, shown: str | None) -> Any:
        path = (pathname or "/").rstrip("/") or "/"
        if path == shown:  # only the query string changed: the page keeps what was typed
            return dash.no_update, dash.no_update
        return page(path, search), path

    def page(path: str, search: str | None) -> Any:
        if path == "/":
            return runs_layout()
        if path == "/alerts":
            return alerts_page.layout(search, runs=_run_names(client), refresh_s=refresh_s)
        if path.startswith("/runs/"):
            rest = path[len("/runs/") :]
            for suffix, module in (("/ranks", ranks_page), ("/hardware", hardware_page)):
                if rest.endswith(suffix) and len(rest) > len(suffix):
                    return module.layout(unquote(rest[: -len(suffix)]), search, refresh_s=refresh_s)
            return run_layout(unquote(rest), refresh_s=refresh_s)
        return notice(f"No page at {path}. Go to the runs list.", "error")

    @app.callback(Output("runs-table", "children"), Input("runs-interval", "n_intervals"))
    def refresh_runs(_n: int | None) -> Any:
        try:
            return runs_table(client)
        except Exception as exc:
            log.exception("runs page")
            return notice(
                f"Cannot read runs from the collector's database: {exc.__class__.__name__}. "
                "It retries by itself.",
                "error",
            )

    alerts_page.register(app, client)
    ranks_page.register(app, client)
    hardware_page.register(app, client)

    # The theme: toggled in the top bar, kept in the browser, applied to the document.
    app.clientside_callback(
        """function(n, theme) {
            if (!n) { return window.dash_clientside.no_update; }
            return theme === "dark" ? "light" : "dark";
        }""",
        Output("theme", "data"),
        Input("theme-toggle", "n_clicks"),
        State("theme", "data"),
    )
    app.clientside_callback(
        """function(theme) {
            document.documentElement.dataset.theme = theme || "light";
            return window.dash_clientside.no_update;
        }""",
        Output("theme-toggle", "title"),
        Input("theme", "data"),
    )

    @app.callback(
        Output("run-header", "children"),
        Output("run-notice", "children"),
        Output("run-alerts", "children"),
        Output("run-ranks", "children"),
        *[Output(f"run-{g}", "figure") for g in RUN_GRAPHS],
        Input("run-interval", "n_intervals"),
        State("run-name", "data"),
    )
    def refresh_run(_n: int | None, name: str) -> Any:
        try:
            run = client.get_run(name)
            panel = ranks_panel(run, client.gpu(name, since=time.time() - 120), client.events(name))
            return (run_header(client, name), None, run_alerts(client, name), panel,
                    *run_figures(client, name))  # fmt: skip
        except NotFound:
            message = f"Run {name!r} not found. It appears once its first agent reports."
            empty = figures.empty_figure("No data")
            return (html.H2(name), notice(message, "error"), None, None, *[empty] * len(RUN_GRAPHS))
        except Exception as exc:
            log.exception("run page %s", name)
            empty = figures.empty_figure("Data unavailable")
            message = f"Cannot read run data: {exc.__class__.__name__}. Retrying."
            return (html.H2(name), notice(message, "error"), None, None, *[empty] * len(RUN_GRAPHS))

    return app
