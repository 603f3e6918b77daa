"""The run page's callbacks (component ids start with ``ri-``): the live refresh and the
comparison with another run, each registered by its own function."""

from __future__ import annotations

import logging
import time
from typing import Any

import dash
from dash import Input, Output, State

from trainwarden.collector.read.queries import NotFound

from ...client import Client
from ...components import notice
from .data import PARTS, changed, diff_part, failed, page_parts

log = logging.getLogger(__name__)


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks (component ids start with ``ri-``)."""
    register_refresh(app, client)
    register_compare(app, client)


def register_refresh(app: dash.Dash, client: Client) -> None:
    """Every part of the page, redrawn only where its content changed."""

    @app.callback(
        *[Output(k, "children") for k in PARTS],
        Output("ri-breakdown", "figure"),
        Output("ri-compare", "options"),
        Output("ri-digests", "data"),
        Input("ri-interval", "n_intervals"),
        Input("theme", "data"),
        State("ri-run", "data"),
        State("ri-digests", "data"),
    )
    def refresh(_n: int | None, theme: str | None, name: str, seen: dict[str, str] | None) -> Any:
        try:
            parts = page_parts(client, name, theme, now=time.time())
        except NotFound:
            parts = failed(
                f"Run {name!r} not found. A run appears once its first agent "
                "reports; check the name, or pick one from the runs list.",
                theme,
                name,
            )
        except Exception as exc:  # the page says so and retries; never a traceback
            log.exception("run page %s", name)
            parts = failed(
                f"Cannot read the run from the collector's database: "
                f"{exc.__class__.__name__}. The page retries by itself.",
                theme,
                name,
            )
        outputs, digests = changed(parts, seen)
        return (*outputs, digests)


def register_compare(app: dash.Dash, client: Client) -> None:
    """The diff with the run picked in the comparison's dropdown."""

    @app.callback(
        Output("ri-diff", "children"),
        Input("ri-compare", "value"),
        State("ri-run", "data"),
        prevent_initial_call=True,
    )
    def compare(other: str | None, name: str) -> Any:
        try:
            return diff_part(client, name, other)
        except Exception as exc:
            log.exception("run page %s: diff with %s", name, other)
            return notice(f"Cannot compare: {exc.__class__.__name__}. Try again.", "error")
