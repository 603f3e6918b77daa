"""The run page, ``/runs/<name>/info``: what the run is (config, tags, data snapshot,
code version, environment), its attempts, its goodput (ETTR and where the rest of the
allocation went), its checkpoints and the cadence advisor, what it trained on (epoch
coverage, the data mixture, data events) and a diff against another run. What it draws
comes from :mod:`.run_info` and :mod:`.data_panel`; the data from the collector's run
identity, economics and data routes, called in-process through the client.

A live refresh redraws only the parts whose content changed, so a scrolled config table
or a chosen comparison stays as the user left it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import dash
from dash import Input, Output, State, dcc, html

from trainwarden.collector.read.queries import NotFound

from ...client import Client
from ...components import digest, notice, run_tabs
from . import data_panel
from . import panels as view

log = logging.getLogger(__name__)
PARTS = ("ri-notice", "ri-identity", "ri-attempts", "ri-goodput", "ri-checkpoints", "ri-data")
REFRESH_S = 5.0  # economics change slowly; each refresh reads the run's step rollups


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    return html.Div(
        [
            dcc.Store(id="ri-run", data=name),
            html.H2(name),
            run_tabs(name, "Run"),
            html.Div(id="ri-notice", role="status"),
            html.H3("Goodput"),
            html.Div(id="ri-goodput", children=notice("Loading goodput…")),
            dcc.Graph(
                id="ri-breakdown",
                config={"displaylogo": False, "displayModeBar": False},
                figure=view.breakdown_figure(None, theme=None, revision=name),
            ),
            html.H3("Checkpoints and cadence"),
            html.Div(id="ri-checkpoints"),
            html.H3("Data"),
            html.Div(id="ri-data"),
            html.H3("Attempts"),
            html.Div(id="ri-attempts"),
            html.H3("Identity"),
            html.Div(id="ri-identity"),
            html.H3("Compare with another run"),
            html.Div(
                dcc.Dropdown(
                    id="ri-compare",
                    placeholder="Pick a run to compare its config, code, environment and packages",
                    clearable=True,
                ),
                className="ri-compare",
            ),
            html.Div(id="ri-diff"),
            dcc.Store(id="ri-digests", data={}),
            dcc.Interval(id="ri-interval", interval=int(max(refresh_s, REFRESH_S) * 1000)),
        ]
    )


def page_parts(client: Client, name: str, theme: str | None, *, now: float) -> dict[str, Any]:
    """Every part of the page by component id (``NotFound``: no such run)."""
    econ = client.economics(name)
    tries = client.attempts(name)
    ident = client.identity(name) if tries else None
    others = sorted(r.name for r in client.list_runs() if r.name != name)
    return {
        "ri-notice": None,
        "ri-identity": view.identity_section(ident),
        "ri-attempts": view.attempts_table(tries, now=now),
        "ri-goodput": view.goodput_section(econ["goodput"]),
        "ri-checkpoints": view.checkpoints_section(econ["checkpoints"], econ["advisor"]),
        "ri-data": data_panel.section(client.data(name), theme=theme, revision=name),
        "ri-breakdown.figure": view.breakdown_figure(econ["goodput"], theme=theme, revision=name),
        "ri-compare.options": others,
    }


def failed(message: str, theme: str | None, name: str) -> dict[str, Any]:
    return {
        "ri-notice": notice(message, "error"),
        **{part: None for part in PARTS[1:]},
        "ri-breakdown.figure": view.breakdown_figure(None, theme=theme, revision=name),
        "ri-compare.options": [],
    }


KEYS = (*PARTS, "ri-breakdown.figure", "ri-compare.options")


def changed(parts: dict[str, Any], seen: dict[str, str] | None) -> tuple[list[Any], dict[str, str]]:
    """The outputs in ``KEYS`` order, ``no_update`` for those drawn as they are already."""
    digests = {k: digest(parts[k]) for k in KEYS}
    seen = seen or {}
    return [dash.no_update if seen.get(k) == digests[k] else parts[k] for k in KEYS], digests


def diff_part(client: Client, name: str, other: str | None) -> Any:
    if not other:
        return None
    try:
        if not client.attempts(other):
            return notice(
                f"Run {other!r} has no identity (its agents are older than 0.11): "
                "nothing to compare."
            )
        return view.diff_view(client.diff(name, other))
    except NotFound:
        return notice(f"Run {other!r} not found any more; pick another.", "error")


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks (component ids start with ``ri-``)."""

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
