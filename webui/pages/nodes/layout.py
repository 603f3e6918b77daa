"""The nodes list (``/nodes``) and one node's record (``/nodes/<name>``), refreshed live."""

from __future__ import annotations

from dash import dcc, html

from ...components import notice


def layout() -> html.Div:
    return html.Div(
        [
            html.H2("Nodes"),
            html.P(
                "The nodes that hurt training in the last 7 days, across runs: XIDs, ECC, "
                "throttles, stragglers, hang culprits, SDC, crash loops and evictions. "
                "`trainwarden nodes exclude --format slurm` prints the list to start the "
                "next job without.",
                className="hint",
            ),
            html.Div(id="nodes-table", children=notice("Loading nodes…")),
            dcc.Interval(id="nodes-interval", interval=10_000),
        ]
    )


def node_layout(name: str) -> html.Div:
    return html.Div(
        [
            html.H2(["Node ", html.Code(name)]),
            dcc.Store(id="node-name", data=name),
            html.Div(id="node-record", children=notice("Loading the node's record…")),
            dcc.Interval(id="node-interval", interval=10_000),
        ]
    )
