"""The Dash app: the routing, the top bar and the theme, around the pages.

Each page is a folder of :mod:`.pages`: the runs list at ``/`` (``runs``), a run's
overview at ``/runs/<name>`` (``overview``), its ranks, hardware, timeline and run pages
at ``/runs/<name>/ranks``, ``/hardware``, ``/timeline`` and ``/info`` (``ranks``,
``hardware``, ``timeline``, ``run_info``), the alerts page at ``/alerts``
(``alerts``), and the nodes' records at ``/nodes`` and ``/nodes/<name>`` (``nodes``). A
page's ``layout.py`` makes its components, its ``callbacks.py``
registers its callbacks; component ids carry the page prefix (``runs-``, ``run-``,
``ranks-``, ``alerts-``...); the shared chart helpers are in :mod:`.charts`. A data error
shows as a message in the page, never as a traceback.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import dash
import flask
from dash import Input, Output, State, dcc, html

from .client import Client
from .components import notice
from .pages.alerts import callbacks as alerts_callbacks
from .pages.alerts import layout as alerts_layout
from .pages.hardware import callbacks as hardware_callbacks
from .pages.hardware import layout as hardware_layout
from .pages.nodes import callbacks as nodes_callbacks
from .pages.nodes import layout as nodes_layout
from .pages.overview import callbacks as overview_callbacks
from .pages.overview import layout as overview_layout
from .pages.ranks import callbacks as ranks_callbacks
from .pages.ranks import layout as ranks_layout
from .pages.run_info import callbacks as run_info_callbacks
from .pages.run_info import layout as run_info_layout
from .pages.runs import callbacks as runs_callbacks
from .pages.runs import layout as runs_layout
from .pages.timeline import callbacks as timeline_callbacks
from .pages.timeline import layout as timeline_layout
from .plotly_js import install_partial_plotly
from .polyfill import replace_babel_polyfill

log = logging.getLogger(__name__)
ASSETS = os.path.join(os.path.dirname(__file__), "assets")
# A run's pages besides its overview, by the suffix of their path.
RUN_PAGES = (
    ("/ranks", ranks_layout),
    ("/hardware", hardware_layout),
    ("/timeline", timeline_layout),
    ("/info", run_info_layout),
)


# -- routing ---------------------------------------------------------------------


def page_path(pathname: str | None) -> str:
    """The page a location's path names, as the routing keeps it (no trailing slash)."""
    return (pathname or "/").rstrip("/") or "/"


def asked_page() -> tuple[str | None, str]:
    """The path and query string (``"?..."`` or ``""``), as the browser's location has
    them, of the page whose layout the browser asks for: Dash's ``_dash-layout`` request
    is made by that page, which its Referer names (a same-origin request carries the whole
    address by default). ``(None, "")`` outside a request, with no Referer, or with one
    from another site (a proxy that rewrites the Host header, say)."""
    if not flask.has_request_context() or not flask.request.referrer:
        return None, ""
    asked = urlsplit(flask.request.referrer)
    if asked.netloc != flask.request.host or not asked.path.startswith("/"):
        return None, ""
    return asked.path, (f"?{asked.query}" if asked.query else "")


def _run_names(client: Client) -> list[str]:
    try:
        return [r.name for r in client.list_runs()]
    except Exception:  # the page's own refresh says what is wrong
        log.exception("alerts page: run names")
        return []


def page(path: str, search: str | None, *, client: Client, refresh_s: float) -> Any:
    """The page at ``path`` (as :func:`page_path` keeps it), opened with ``search``."""
    if path in ("/", "/runs"):
        return runs_layout.layout()
    if path == "/nodes":
        return nodes_layout.layout()
    if path.startswith("/nodes/") and len(path) > len("/nodes/"):
        return nodes_layout.node_layout(unquote(path[len("/nodes/") :]))
    if path == "/alerts":
        return alerts_layout.layout(search, runs=_run_names(client), refresh_s=refresh_s)
    if path.startswith("/runs/"):
        rest = path[len("/runs/") :]
        for suffix, module in RUN_PAGES:
            if rest.endswith(suffix) and len(rest) > len(suffix):
                return module.layout(unquote(rest[: -len(suffix)]), search, refresh_s=refresh_s)
        return overview_layout.layout(unquote(rest), search, refresh_s=refresh_s)
    return notice(f"No page at {path}. Go to the runs list.", "error")


def shell(page: Callable[[str, str | None], Any]) -> html.Div:
    """The app's layout: the top bar, the page the browser asks for (``page(path,
    search)``), and the routing's stores."""
    # The page the browser is opening is in the layout already (see asked_page): its
    # callbacks fire at load, not after a routing callback's round trip (whose pending
    # ``children`` output would also hold every other callback back).
    asked, search = asked_page()
    path = shown = None
    if asked is not None:
        try:
            path = page_path(asked)
            shown = page(path, search)
        except Exception:  # the routing callback makes it, and says what is wrong
            log.exception("page %s", asked)
            path = shown = None
    # With the page in the layout, the address is too: the Location reports no change
    # when it mounts, so the routing callback does not fire (refresh=False: no value
    # here ever sends the browser anywhere).
    address = {"pathname": asked, "search": search} if path is not None else {}
    return html.Div(
        [
            dcc.Location(id="url", refresh=False, **address),
            # "light" or "dark", kept in the browser; figures take it as an Input.
            dcc.Store(id="theme", storage_type="local", data="light"),
            html.Header(
                [
                    dcc.Link("trainwarden", href="/", className="brand"),
                    dcc.Link("Runs", href="/", className="nav"),
                    dcc.Link("Alerts", href="/alerts", className="nav"),
                    dcc.Link("Nodes", href="/nodes", className="nav"),
                    html.A("Runbooks", href="/runbooks", className="nav"),
                    html.Button(
                        "◐ Theme",
                        id="theme-toggle",
                        className="theme-toggle",
                        title="Light / dark",
                    ),
                ],
                className="topbar",
            ),
            html.Main(id="page", className="page", children=shown),
            dcc.Store(id="page-path", data=path),
            dcc.Store(id="page-kick"),  # routes at load when the layout has no page
        ]
    )


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
    install_partial_plotly(app)  # plotly.js: a custom bundle, preloaded (webui/plotly_js.py)
    replace_babel_polyfill(app)  # regenerator-runtime alone, not core-js too (webui/polyfill.py)

    def page_at(path: str, search: str | None) -> Any:
        return page(path, search, client=client, refresh_s=refresh_s)

    def layout() -> html.Div:
        return shell(page_at)

    app.layout = layout
    register_routing(app, page_at)
    runs_callbacks.register(app, client)
    alerts_callbacks.register(app, client)
    ranks_callbacks.register(app, client)
    hardware_callbacks.register(app, client)
    timeline_callbacks.register(app, client)
    run_info_callbacks.register(app, client)
    overview_callbacks.register(app, client)
    nodes_callbacks.register(app, client)
    register_theme(app)
    return app


def register_routing(app: dash.Dash, page: Callable[[str, str | None], Any]) -> None:
    """The routing callback: the page at the location's path, made by ``page``."""
    # At load, the routing callback runs only when the layout came without the page (no
    # Referer): a clientside callback starts it then.
    app.clientside_callback(
        """function(pathname, shown) {
            return shown ? window.dash_clientside.no_update : (pathname || "/");
        }""",
        Output("page-kick", "data"),
        Input("url", "pathname"),
        State("page-path", "data"),
    )

    @app.callback(
        Output("page", "children"),
        Output("page-path", "data"),
        Input("url", "pathname"),
        Input("page-kick", "data"),
        State("url", "search"),
        State("page-path", "data"),
        prevent_initial_call=True,  # the layout has the first page (see shell)
    )
    def route(
        pathname: str | None, _kick: str | None, search: str | None, shown: str | None
    ) -> Any:
        path = page_path(pathname)
        if path == shown:  # only the query string changed: the page keeps what was typed
            return dash.no_update, dash.no_update
        return page(path, search), path


def register_theme(app: dash.Dash) -> None:
    """The theme: toggled in the top bar, kept in the browser, applied to the document."""
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


def warm_up(app: dash.Dash) -> None:
    """Dash sets itself up on its first requests (~0.3 s on 2 vCPU, measured): make them
    when the server starts (``serve``'s lifespan), not while the first visitor waits for a
    graph. They read no data. After this, Flask takes no new routes."""
    warm = app.server.test_client()
    for route in ("", "_dash-layout", "_dash-dependencies"):
        warm.get(app.config.routes_pathname_prefix + route)
