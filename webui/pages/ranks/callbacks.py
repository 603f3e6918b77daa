"""The ranks page's callbacks (component ids start with ``ranks-``): the heatmaps, the
user metric's picker and heatmap, the replica checks, the rank states with the
Collectives section, its read button, and the clicks and zooms that write the URL; each
group registered by its own function."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import dash
from dash import ALL, Input, Output, State, dcc, html
from plotly.io.json import to_json_plotly

from trainwarden.collector.read.queries import NotFound

from ...charts import empty_figure, themed
from ...client import Client
from ...components import is_default_pick, notice, parse_user
from ...first_graph import after_first
from ...gestures import hold_while_pointing
from . import collectives_panel as coll
from .actions import read_collectives
from .data import (
    HEATMAPS,
    STEP_HEATMAPS,
    TITLES,
    USER_EMPTY,
    collectives_part,
    heatmap_part,
    states_part,
    user_choices,
    user_heatmap_part,
)
from .preflight_panel import preflight_table
from .query import apply_gestures, parse_query, query_string
from .replicas_panel import strips as replica_strips

log = logging.getLogger(__name__)


def _guarded(what: str, name: str, draw: Callable[[], Any], failed: Callable[[str], Any]) -> Any:
    try:
        return draw()
    except NotFound:
        return failed(f"Run {name!r} not found.")
    except Exception as exc:  # the page says so and retries; never a traceback
        log.exception("ranks page %s: %s", what, name)
        return failed(f"Cannot read {what}: {exc.__class__.__name__}. Retrying.")


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks (component ids start with ``ranks-``)."""
    register_heatmaps(app, client)
    register_user_picker(app, client)
    register_user_heatmap(app, client)
    register_replicas(app, client)
    register_preflight(app, client)
    register_states(app, client)
    register_collectives(app, client)
    register_gestures(app)


def register_heatmaps(app: dash.Dash, client: Client) -> None:
    """The built-in heatmaps: the step time's first (on the refresh ticks, held while a
    pointer is down), then the others after it, one callback each."""

    def part(key: str, search: str | None, theme: str | None, name: str) -> Any:
        def failed(message: str) -> Any:
            return themed(empty_figure(f"{TITLES[key]}: {message}"), theme)

        return _guarded(
            TITLES[key].lower(),
            name,
            lambda: heatmap_part(client, name, key, search, theme),
            failed,
        )

    first, *others = HEATMAPS
    hold_while_pointing(app, "ranks-heat-interval", "ranks-heat-tick")

    @app.callback(
        Output(f"ranks-{first}", "figure"),
        Output("ranks-heat-drawn", "data"),
        Input("ranks-heat-tick", "data"),  # held while a pointer is down on a heatmap
        Input("ranks-url", "search"),
        Input("theme", "data"),
        State("ranks-run", "data"),
    )
    def draw_first(n: int | None, search: str | None, theme: str | None, name: str) -> Any:
        return part(first, search, theme, name), [n, search, theme]

    def heatmap_callback(key: str) -> None:
        @app.callback(
            Output(f"ranks-{key}", "figure"),
            Input("ranks-heat-drawn", "data"),
            State("ranks-url", "search"),
            State("theme", "data"),
            State("ranks-run", "data"),
        )
        def draw(_drawn: Any, search: str | None, theme: str | None, name: str) -> Any:
            return part(key, search, theme, name)

    for key in others[:-1]:
        heatmap_callback(key)

    last = others[-1]

    @app.callback(
        Output(f"ranks-{last}", "figure"),
        Output("ranks-heat-done", "data"),
        Input("ranks-heat-drawn", "data"),
        State("ranks-url", "search"),
        State("theme", "data"),
        State("ranks-run", "data"),
    )
    def draw_last(drawn: Any, search: str | None, theme: str | None, name: str) -> Any:
        """The last of the built-in heatmaps; then the user metric's (below them all), so
        that it does not compete with the first heatmap while the page loads."""
        return part(last, search, theme, name), drawn


def register_user_picker(app: dash.Dash, client: Client) -> None:
    """The user metric's picker and heatmap, made once the built-in heatmaps are drawn."""

    @app.callback(
        Output("ranks-user-box", "children"),
        Input("ranks-heat-done", "data"),
        State("ranks-user-box", "children"),
        State("ranks-url", "search"),
        State("theme", "data"),
        State("ranks-run", "data"),
    )
    def user_box(
        _done: Any, children: Any, search: str | None, theme: str | None, name: str
    ) -> Any:
        """The picker and the heatmap, made once (later refreshes update them in place);
        a hint instead while the run has no user metric."""
        if children and _has_picker(children):
            return dash.no_update
        try:
            options, value = user_choices(client, name, search)
        except Exception:  # the heatmaps say what is wrong
            return dash.no_update
        if not options:
            return html.P(USER_EMPTY, className="hint")
        figure = _guarded(
            "the user metric",
            name,
            lambda: user_heatmap_part(client, name, value, search, theme),
            lambda message: themed(empty_figure(f"User metric: {message}"), theme),
        )
        return [
            html.Div(
                [
                    html.Span("User metric ", className="fact-key"),
                    # RadioItems, not a Dropdown: dcc's Dropdown is a chunk loaded on demand.
                    dcc.RadioItems(
                        id="ranks-user-metric",
                        options=options,
                        value=value,
                        inline=True,
                        className="user-pick",
                    ),
                ],
                className="ranks-user-pick",
                style={"margin": "0.5rem 0"},
            ),
            dcc.Graph(id="ranks-user", figure=figure, config={"displaylogo": False}),
        ]


def register_user_heatmap(app: dash.Dash, client: Client) -> None:
    """The user metric's heatmap, drawn again on a pick and with the heatmaps' refresh."""

    @app.callback(
        Output("ranks-user-metric", "options"),
        Output("ranks-user", "figure"),
        Input("ranks-user-metric", "value"),
        Input("ranks-heat-done", "data"),
        State("ranks-url", "search"),
        State("theme", "data"),
        State("ranks-run", "data"),
        prevent_initial_call=True,
    )
    def draw_user(
        metric: str | None, _done: Any, search: str | None, theme: str | None, name: str
    ) -> Any:
        """A pick, or a refresh with the heatmaps: the run's metrics and the heatmap."""

        def failed(message: str) -> Any:
            return themed(empty_figure(f"User metric: {message}"), theme)

        options: Any
        try:
            options = user_choices(client, name, search)[0]
        except Exception:  # the figure below says what is wrong
            options = dash.no_update
        figure = _guarded(
            "the user metric",
            name,
            lambda: user_heatmap_part(client, name, metric, search, theme),
            failed,
        )
        return options, figure


def register_replicas(app: dash.Dash, client: Client) -> None:
    """The replica checks' strips (silent data corruption), after the first heatmap."""
    # The page's first call of the callbacks below (and of the rank states') waits for
    # the first heatmap.
    after_first(app, ("ranks-heat-drawn", "data"), "ranks-first")

    @app.callback(
        Output("ranks-replicas", "children"),
        Input("ranks-heat-interval", "n_intervals"),
        Input("ranks-first", "data"),
        State("ranks-run", "data"),
        prevent_initial_call=True,
    )
    def draw_replicas(_n: int | None, _first: bool | None, name: str) -> Any:
        return _guarded(
            "replica checks",
            name,
            lambda: replica_strips(client.replicas(name)),
            lambda message: notice(message, "error"),
        )


def register_preflight(app: dash.Dash, client: Client) -> None:
    """The preflight table (``tw.init(preflight=True)``), after the first heatmap."""

    @app.callback(
        Output("ranks-preflight", "children"),
        Input("ranks-heat-interval", "n_intervals"),
        Input("ranks-first", "data"),
        State("ranks-run", "data"),
        prevent_initial_call=True,
    )
    def draw_preflight(_n: int | None, _first: bool | None, name: str) -> Any:
        return _guarded(
            "preflight",
            name,
            lambda: preflight_table(client.preflight(name)),
            lambda message: notice(message, "error"),
        )


def register_states(app: dash.Dash, client: Client) -> None:
    """The rank states, the selected rank's detail and the Collectives section."""

    @app.callback(
        Output("ranks-notice", "children"),
        Output("ranks-states", "children"),
        Output("ranks-detail", "children"),
        Output(coll.ANCHOR, "children"),
        Output("ranks-coll-bottom", "children"),
        Output("ranks-coll-digest", "data"),
        Input("ranks-interval", "n_intervals"),
        Input("ranks-url", "search"),
        Input("theme", "data"),
        Input("ranks-coll-changed", "data"),
        Input("ranks-first", "data"),
        State("ranks-run", "data"),
        State("ranks-coll-digest", "data"),
        prevent_initial_call=True,
    )
    def refresh(
        _n: int | None,
        search: str | None,
        theme: str | None,
        _asked: int | None,
        _first: bool | None,
        name: str,
        seen: str | None,
    ) -> Any:
        """The rank states and the Collectives section, in one answer: drawn together,
        the section does not push the page down after the states appear."""

        def failed(message: str) -> Any:
            if message.endswith("not found."):
                message = (
                    f"{message} A run appears once its first agent reports; "
                    "check the name, or pick one from the runs list."
                )
            return notice(message, "error"), None, None

        read: dict[str, Any] = {}

        def draw() -> Any:
            read["run"] = run = client.get_run(name)
            return states_part(client, name, search, theme, run=run)

        parts = _guarded("rank states", name, draw, failed)
        if parts[1] is None or "run" not in read:  # the notice says what is wrong
            return (*parts, None, None, None)
        hung = sum(1 for r in read["run"].ranks if r.state == "hung")
        drawn = _guarded(
            "collectives",
            name,
            lambda: collectives_part(client, name, hung=hung),
            lambda message: (None, notice(message, "error")),
        )
        digest = hashlib.sha1(to_json_plotly(drawn).encode()).hexdigest()
        if digest == seen:
            return (*parts, dash.no_update, dash.no_update, dash.no_update)
        return (*parts, *drawn, digest)


def register_collectives(app: dash.Dash, client: Client) -> None:
    """“Read collectives now”, and the scroll to the section the overview's banner links."""

    @app.callback(
        Output("ranks-coll-feedback-top", "children"),
        Output("ranks-coll-feedback-bottom", "children"),
        Output("ranks-coll-changed", "data"),
        # A pattern (the index: where the button is drawn): a callback fires only when
        # all of its inputs are in the page, and the button is in one place or none.
        Input({"type": coll.READ, "index": ALL}, "n_clicks"),
        State("ranks-run", "data"),
        State("ranks-coll-changed", "data"),
        prevent_initial_call=True,
    )
    def read_now(_clicks: list[int | None], name: str, asked: int | None) -> Any:
        """“Read collectives now” (or “again”): every rank is asked, the section reads
        again, and the answer is shown by the button."""
        if not any(t.get("value") for t in dash.ctx.triggered):  # drawn anew, not pressed
            return dash.no_update, dash.no_update, dash.no_update
        try:
            message, kind = read_collectives(client, name)
        except Exception as exc:
            log.exception("ranks page: read collectives %s", name)
            message, kind = (
                f"Not asked: the collector's database failed ({exc.__class__.__name__}). "
                "Try again; if it stays, check the collector's log.",
                "error",
            )
        said = notice(message, kind)
        if (dash.ctx.triggered_id or {}).get("index") == "top":
            return said, None, (asked or 0) + 1
        return None, said, (asked or 0) + 1

    # The overview's banner links to #ranks-collectives: the section is drawn after the
    # page, so the browser cannot scroll to it by itself; once drawn, scroll once.
    app.clientside_callback(
        """function(children) {
            const want = "#ANCHOR", here = window.location.href;
            if (!children || window.location.hash !== want || window._twScrolled === here) {
                return window.dash_clientside.no_update;
            }
            window._twScrolled = here;
            const el = document.querySelector(want);
            if (el) { el.scrollIntoView({block: "start"}); }
            return here;
        }""".replace("ANCHOR", coll.ANCHOR),
        Output("ranks-coll-scrolled", "data"),
        Input(coll.ANCHOR, "children"),
    )


def register_gestures(app: dash.Dash) -> None:
    """Clicks and zooms on the heatmaps, and the user metric's pick, into the URL."""
    # A click or a drag on a heatmap goes, numbered, into a store in the browser (only
    # clicks on a cell and relayouts that set an x range: a live refresh's redraw holds
    # neither, so it never calls follow). follow applies every gesture it has not applied
    # yet: when Dash drops an answer of follow for a newer call (it does, for the same
    # callback), the newer call still applies the older gesture (a single click was lost
    # that way in a loaded CI run).
    for store, graphs, ranged in (
        ("ranks-gestures", [f"ranks-{key}" for key in HEATMAPS], STEP_HEATMAPS),
        ("ranks-user-gestures", ["ranks-user"], ("user",)),
    ):
        app.clientside_callback(
            GESTURES_JS,
            Output(store, "data"),
            *[Input(graph, "clickData") for graph in graphs],
            *[Input(f"ranks-{key}", "relayoutData") for key in ranged],
            State(store, "data"),
            prevent_initial_call=True,
        )

    @app.callback(
        Output("ranks-url", "search"),
        Output("ranks-gesture-applied", "data"),
        Input("ranks-gestures", "data"),
        Input("ranks-user-gestures", "data"),
        State("ranks-gesture-applied", "data"),
        State("ranks-url", "search"),
        prevent_initial_call=True,
    )
    def follow(heat: Any, user: Any, applied: int | None, search: str | None) -> Any:
        """A click picks a rank, a zoom picks a step range: both go to the URL."""
        wanted, last = apply_gestures(search, [heat, user], applied)
        if last == applied:
            return dash.no_update, dash.no_update
        return (dash.no_update if wanted == (search or "") else wanted), last

    @app.callback(
        Output("ranks-url", "search", allow_duplicate=True),
        Input("ranks-user-metric", "value"),
        State("ranks-user-metric", "options"),
        State("ranks-url", "search"),
        prevent_initial_call=True,
    )
    def follow_pick(value: Any, options: Any, search: str | None) -> Any:
        """The user metric's picker: the metric goes to the URL. A callback of its own:
        dash-renderer drops an executing call when the same callback is requested again
        (its duplicate pruning), and a pick redraws the heatmap."""
        if not value or is_default_pick(value, options, parse_user(search)):
            return dash.no_update  # set by a refresh, not picked
        rank, lo, hi = parse_query(search)
        wanted = query_string(rank, lo, hi, user=value)
        return dash.no_update if wanted == (search or "") else wanted


# The gestures on a store's heatmaps (its clickData inputs, then its relayoutData ones,
# then the store as its state), each numbered across the page's stores; the newest 16.
GESTURES_JS = """function() {
    const cc = window.dash_clientside.callback_context;
    const kept = arguments[arguments.length - 1];
    const list = kept && Array.isArray(kept.list) ? kept.list.slice(-15) : [];
    const before = list.length;
    for (const t of cc.triggered || []) {
        const prop = t.prop_id.slice(t.prop_id.lastIndexOf(".") + 1), v = t.value;
        if (prop === "clickData") {
            const p = v && v.points && v.points[0];
            if (!p || p.y === undefined || p.y === null) { continue; }
            window._twGestures = (window._twGestures || 0) + 1;
            list.push({n: window._twGestures, rank: p.y});
        } else if (prop === "relayoutData") {
            const ranged = v && Object.keys(v).some(
                k => /^xaxis\\d*\\.(range(\\[\\d\\])?|autorange)$/.test(k));
            if (!ranged) { continue; }
            window._twGestures = (window._twGestures || 0) + 1;
            list.push({n: window._twGestures, relayout: v});
        }
    }
    return list.length > before ? {list: list} : window.dash_clientside.no_update;
}"""


def _has_picker(children: Any) -> bool:
    """Whether the user box's children (Dash's JSON of them) hold the picker."""
    return "ranks-user-metric" in str(children)
