"""The runs list's callback: the table, refreshed live."""

from __future__ import annotations

import logging
from typing import Any

import dash
from dash import Input, Output

from ...client import Client
from ...components import notice
from .data import runs_table

log = logging.getLogger(__name__)


def register(app: dash.Dash, client: Client) -> None:
    """The page's callback (component ids start with ``runs-``)."""

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
