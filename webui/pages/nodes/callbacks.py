"""The nodes pages' callbacks: the list and one node's record, refreshed live."""

from __future__ import annotations

import logging
from typing import Any

import dash
from dash import Input, Output, State

from ...client import Client
from ...components import notice
from .data import node_record, nodes_table

log = logging.getLogger(__name__)
UNREADABLE = (
    "Cannot read the nodes' records from the collector's database: {}. It retries by itself."
)


def register(app: dash.Dash, client: Client) -> None:
    """The pages' callbacks (component ids start with ``nodes-`` and ``node-``)."""

    @app.callback(Output("nodes-table", "children"), Input("nodes-interval", "n_intervals"))
    def refresh_nodes(_n: int | None) -> Any:
        try:
            return nodes_table(client)
        except Exception as exc:
            log.exception("nodes page")
            return notice(UNREADABLE.format(exc.__class__.__name__), "error")

    @app.callback(
        Output("node-record", "children"),
        Input("node-interval", "n_intervals"),
        State("node-name", "data"),
    )
    def refresh_node(_n: int | None, name: str | None) -> Any:
        try:
            return node_record(client, name or "")
        except Exception as exc:
            log.exception("node page %s", name)
            return notice(UNREADABLE.format(exc.__class__.__name__), "error")
