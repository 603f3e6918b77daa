"""The hardware page's callback (component ids start with ``hw-``): the live refresh,
its ticks held while a pointer is down on a graph."""

from __future__ import annotations

import logging
from typing import Any

import dash
from dash import Input, Output, State

from trainwarden.collector.read.queries import NotFound

from ...charts import empty_figure, themed
from ...client import Client
from ...components import notice
from ...gestures import hold_while_pointing
from ..ranks.preflight_panel import preflight_table
from .data import GRAPHS, page_parts

log = logging.getLogger(__name__)


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

    @app.callback(
        Output("hw-preflight", "children"),
        Input("hw-tick", "data"),
        State("hw-run", "data"),
    )
    def refresh_preflight(_n: int | None, name: str) -> Any:
        try:
            return preflight_table(client.preflight(name))
        except NotFound:
            return None  # the page's notice says so
        except Exception as exc:
            log.exception("hardware page preflight %s", name)
            return notice(
                f"Cannot read the preflight: {exc.__class__.__name__}. Retrying.", "error"
            )
