"""The hardware page of a run, ``/runs/<name>/hardware``: per node / GPU temperature, power,
clocks, throttling, ECC and XID events.

``?rank=N`` narrows the page to that rank's GPU (its links come from the ranks page).
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import quote

import dash
from dash import Input, Output, State, dcc, html

from trainwarden.collector.read.queries import NotFound

from ...charts import empty_figure, themed
from ...client import Client
from ...components import notice, run_tabs
from ...gestures import hold_while_pointing
from ..ranks.callbacks import parse_query
from . import panels as hf

log = logging.getLogger(__name__)
SAMPLES = 20_000  # newest GPU readings drawn (the page stays quick on a big run)
GRAPHS = tuple(hf.FIELDS)


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    graph = {"config": {"displaylogo": False}, "figure": empty_figure("Loading…")}
    return html.Div(
        [
            dcc.Location(id="hw-url", refresh=False),
            dcc.Store(id="hw-run", data=name),
            html.H2(name),
            run_tabs(name, "Hardware"),
            html.Div(id="hw-notice", role="status"),
            html.H3("GPUs by node"),
            html.Div(id="hw-gpus", children=notice("Loading GPUs…")),
            html.H3("XID errors"),
            html.Div(id="hw-xids"),
            *[dcc.Graph(id=f"hw-{key}", **graph) for key in GRAPHS],
            dcc.Interval(id="hw-interval", interval=int(max(refresh_s, 2.0) * 1000)),
            dcc.Store(id="hw-tick"),  # its ticks, held while a pointer is down on a graph
        ]
    )


def page_parts(client: Client, name: str, search: str | None, theme: str | None) -> tuple[Any, ...]:
    """(notice, GPU table, XID table, *graphs in GRAPHS order)."""
    rank, _, _ = parse_query(search)
    run = client.get_run(name)
    samples = client.gpu(name, rank=rank, limit=SAMPLES)
    events = client.events(name, kind="xid")
    if rank is not None:
        events = [e for e in events if e.rank == rank]
    note = None
    if rank is not None:
        everyone = f"/runs/{quote(name, safe='')}/hardware"
        note = html.Div(
            [f"Showing rank {rank}'s GPU only. ", dcc.Link("Show every GPU", href=everyone)],
            className="notice",
        )
    elif not samples:
        note = notice(
            "No GPU readings for this run yet. Each agent samples its GPU through NVML every "
            "TRAINWARDEN_GPU_INTERVAL seconds (5 by default); a host without an NVIDIA driver "
            "reports no telemetry, shown per rank below."
        )
    revision = f"{name}:{rank}"
    graphs = [hf.gpu_figure(samples, key, theme=theme, revision=revision) for key in GRAPHS]
    xids = hf.xid_rows(events, run.ranks)
    table = hf.gpu_table(name, samples, run.ranks, selected=rank, xids=xids)
    return (note, table, hf.xid_table(xids), *graphs)


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks (component ids start with ``hw-``)."""
    hold_while_pointing(app, "hw-interval", "hw-tick")

    @app.callback(
        Output("hw-notice", "children"),
        Output("hw-gpus", "children"),
        Output("hw-xids", "children"),
        *[Output(f"hw-{key}", "figure") for key in GRAPHS],
        Input("hw-tick", "data"),  # the interval's, held while a pointer is down on a graph
        Input("hw-url", "search"),
        Input("theme", "data"),
        State("hw-run", "data"),
    )
    def refresh(_n: int | None, search: str | None, theme: str | None, name: str) -> Any:
        try:
            return page_parts(client, name, search, theme)
        except NotFound:
            message = (
                f"Run {name!r} not found. A run appears once its first agent reports; "
                "check the name, or pick one from the runs list."
            )
        except Exception as exc:  # the page says so and retries; never a traceback
            log.exception("hardware page %s", name)
            message = f"Cannot read GPU data: {exc.__class__.__name__}. Retrying."
        empty = themed(empty_figure("No data"), theme)
        return (notice(message, "error"), None, None, *[empty] * len(GRAPHS))
