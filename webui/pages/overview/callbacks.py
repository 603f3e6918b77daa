"""The overview's callbacks (component ids start with ``run-``): the header and panels,
the figure, the user metric's picker and figure, and the view (axis, rank, range, pick)
kept in the URL, each group registered by its own function."""

from __future__ import annotations

import logging
import time
from typing import Any

import dash
from dash import Input, Output, State, html

from trainwarden.collector.read.queries import NotFound

from ...charts import empty_figure, themed
from ...client import Client
from ...components import is_default_pick, notice, user_choices
from ...first_graph import after_first
from ...gestures import hold_while_pointing
from .data import hang_banner, load, range_label, run_alerts, user_part
from .figures import overview_figure, prepare
from .panels import ranks_panel, run_header
from .query import AXES, parse_query, range_from_relayout, to_query

log = logging.getLogger(__name__)


def register(app: dash.Dash, client: Client) -> None:
    """The page's callbacks."""
    prepare()
    register_header(app, client)
    register_chart(app, client)
    register_user_metric(app, client)
    register_drag(app)
    register_view(app)


def register_header(app: dash.Dash, client: Client) -> None:
    """The run's facts, the hang banner, its open alerts and its ranks panel."""

    @app.callback(
        Output("run-header", "children"),
        Output("run-notice", "children"),
        Output("run-alerts", "children"),
        Output("run-ranks", "children"),
        Input("run-interval", "n_intervals"),
        Input("run-drawn", "data"),  # the first call, once the chart's figure is back
        State("run-name", "data"),
        prevent_initial_call=True,  # (see first_graph)
    )
    def refresh_run(_n: int | None, _drawn: bool | None, name: str) -> Any:
        try:
            run = client.get_run(name)
            panel = ranks_panel(run, client.gpu(name, since=time.time() - 120), client.events(name))
            return run_header(run), hang_banner(client, run), run_alerts(client, name), panel
        except NotFound:
            message = (
                f"Run {name!r} not found. It appears once its first agent reports; "
                "check the run name, or pick a run from the runs list."
            )
            return html.H2(name), notice(message, "error"), None, None
        except Exception as exc:
            log.exception("run page %s", name)
            message = f"Cannot read run data: {exc.__class__.__name__}. Retrying every few seconds."
            return dash.no_update, notice(message, "error"), dash.no_update, dash.no_update


def register_chart(app: dash.Dash, client: Client) -> None:
    """The stacked figure, drawn for the view (and the steps it maps the x-axis to)."""

    @app.callback(
        Output("run-overview", "figure"),
        Output("run-xmap", "data"),
        Output("run-range", "children"),
        Input("run-tick", "data"),  # the interval's, held while a pointer is down on a chart
        Input("run-view", "data"),
        Input("theme", "data"),
        State("run-name", "data"),
    )
    def draw(_n: int | None, view: dict[str, Any], theme: str | None, name: str) -> Any:
        axis = view.get("axis", "step")
        try:
            data = load(client, name, view)
        except NotFound:
            fig = empty_figure(f"Run {name!r} not found")
            return themed(fig, theme), None, ""
        except Exception as exc:  # the last drawn figure stays; the header says what is wrong
            log.exception("run overview %s", name)
            return (
                dash.no_update,
                dash.no_update,
                f"Cannot read data ({exc.__class__.__name__}); retrying.",
            )
        base = data.series["step_time"]
        lo, hi = view.get("from"), view.get("to")
        x_range = None
        if (lo is not None or hi is not None) and base.step:
            x_range = (base.step[0] if lo is None else lo, base.step[-1] if hi is None else hi)
        fig = overview_figure(
            data, axis=axis, theme=theme, revision=f"{name}|{axis}", x_range=x_range
        )
        return fig, {"step": base.step, "ts": base.ts}, range_label(data, view)


def register_user_metric(app: dash.Dash, client: Client) -> None:
    """The picker of the run's own metrics, and the picked metric's figure."""

    @app.callback(
        Output("run-user-metric", "options"),
        Output("run-user-metric", "value"),
        Input("run-xmap", "data"),
        State("run-view", "data"),
        State("run-name", "data"),
        State("run-user-metric", "options"),
        State("run-user-metric", "value"),
    )
    def pick_user(
        _drawn: Any,
        view: dict[str, Any],
        name: str,
        shown: list[dict[str, str]] | None,
        value: str | None,
    ) -> Any:
        """The run's own metrics, refreshed after each drawing of the overview (so that
        they do not compete with it while the page loads); the value is set only while
        the picker has none the run offers (the URL's pick, else the first metric): a
        refresh called between a click and ``sync``'s record of it in the view would
        otherwise put the old pick back (a browser test lost the click that way). The
        URL's pick on back / forward is ``sync``'s to set.

        Only what changed is set: setting the picker's value fires ``sync``, and a
        refresh that called it while a zoom's call was in flight made Dash drop the
        zoom's answer (its duplicate pruning), so that a drag was sometimes lost."""
        try:
            options, pick = user_choices(client, name, view.get("user"))
        except Exception:  # the page's notice says what is wrong
            return dash.no_update, dash.no_update
        offered = {o["value"] for o in options}
        return (
            options if options != shown else dash.no_update,
            pick if value not in offered and pick != value else dash.no_update,
        )

    @app.callback(
        Output("run-user", "figure"),
        Input("run-xmap", "data"),
        Input("run-user-metric", "value"),
        State("run-view", "data"),
        State("theme", "data"),
        State("run-name", "data"),
    )
    def draw_user(
        _drawn: Any, metric: str | None, view: dict[str, Any], theme: str | None, name: str
    ) -> Any:
        try:
            return user_part(client, name, view, metric or view.get("user"), theme)
        except NotFound:
            return themed(empty_figure(f"Run {name!r} not found"), theme)
        except Exception:  # the last drawn figure stays
            log.exception("run page user metric %s", name)
            return dash.no_update


def register_drag(app: dash.Dash) -> None:
    """The refresh ticks (held while a pointer is down), the flag of the first drawing,
    and each drag on the figure, numbered, into a store for ``sync``."""
    hold_while_pointing(app, "run-interval", "run-tick")
    after_first(app, ("run-range", "children"), "run-drawn")  # set by every draw()

    # A drag (or a double click) on the chart, numbered, into a store, in the browser:
    # only relayouts that set an x range, so that a refresh's redraw (its relayout holds
    # none) never calls sync. sync applies the newest drag whatever input fired it: when
    # Dash drops an answer of sync for a newer call (it does, for the same callback), the
    # newer call still applies the drag (a single drag right after the first draw was
    # lost that way in loaded CI runs).
    app.clientside_callback(
        """function(relayout) {
            const ranged = relayout && Object.keys(relayout).some(
                k => /^xaxis\\d*\\.(range(\\[\\d\\])?|autorange)$/.test(k));
            if (!ranged) { return window.dash_clientside.no_update; }
            window._twDrags = (window._twDrags || 0) + 1;
            return {n: window._twDrags, relayout: relayout};
        }""",
        Output("run-drag", "data"),
        Input("run-overview", "relayoutData"),
        prevent_initial_call=True,
    )


def register_view(app: dash.Dash) -> None:
    """The view in the URL: a drag on the figure, the axis, the rank, "Whole run" and
    the user metric's pick write it; back / forward set them from it."""

    @app.callback(
        Output("run-url", "search"),
        Output("run-view", "data"),
        Output("run-axis", "value"),
        Output("run-rank", "value"),
        Output("run-user-metric", "value", allow_duplicate=True),
        Input("run-url", "search"),
        Input("run-drag", "data"),
        Input("run-axis", "value"),
        Input("run-rank", "value"),
        Input("run-reset", "n_clicks"),
        Input("run-user-metric", "value"),
        State("run-user-metric", "options"),
        State("run-view", "data"),
        State("run-xmap", "data"),
        prevent_initial_call=True,
    )
    def sync(
        search: str | None,
        drag: dict[str, Any] | None,
        axis: str | None,
        rank: Any,
        _reset: int | None,
        user: str | None,
        options: list[dict[str, str]] | None,
        view: dict[str, Any],
        xmap: dict[str, list[Any]] | None,
    ) -> Any:
        keep = dash.no_update
        # Every input that fired: Dash sends those that changed together in one call, in
        # no set order (a pick and a refresh's relayout of the chart can come together).
        fired = [t["prop_id"].rpartition(".")[0] for t in dash.ctx.triggered]
        if "run-url" in fired:  # opened, or back / forward in the browser
            want, shown = _navigated(search, drag, view, options)
            return (
                keep,
                want if want != view else keep,
                want["axis"] if want["axis"] != axis else keep,
                want["rank"] if want["rank"] != rank else keep,
                shown if shown is not None and shown != user else keep,
            )
        want = _dragged(view, drag, xmap)
        for trigger in fired:
            if trigger == "run-axis":
                want["axis"] = axis if axis in AXES else "step"
            elif trigger == "run-rank":
                want["rank"] = int(rank) if isinstance(rank, (int, float)) and rank >= 0 else None
            elif trigger == "run-reset":
                want["from"] = want["to"] = None
            elif (
                trigger == "run-user-metric"
                and user
                and not is_default_pick(user, options, view.get("user"))
            ):  # a pick (a refresh setting the default is none)
                want["user"] = user
        if want == view:
            return keep, keep, keep, keep, keep
        # "?" for the default view: an empty search would leave the old one in the address bar.
        query = to_query(want) or "?"
        return (query if query != (search or "?") else keep), want, keep, keep, keep


def _navigated(
    search: str | None,
    drag: dict[str, Any] | None,
    view: dict[str, Any],
    options: list[dict[str, str]] | None,
) -> tuple[dict[str, Any], str | None]:
    """The view the URL names (``sync`` on a navigation), and the pick the user metric's
    picker then shows (None: leave it)."""
    want = parse_query(search)
    if drag:  # a drag made before is the page's past, not a new one
        want["drag"] = drag.get("n")
    shown = None
    # The picker is set only by a navigation that changes the pick: a URL written
    # by a drag (or the page's own) leaves it to pick_user, whose first answer may
    # be on its way, and setting it here too made one more call race the drag's.
    if want.get("user") != view.get("user"):
        offered = [o["value"] for o in options or ()]
        shown = want.get("user") if want.get("user") in offered else None
        shown = shown or (offered[0] if offered else None)  # no pick: the first
    return want, shown


def _dragged(
    view: dict[str, Any], drag: dict[str, Any] | None, xmap: dict[str, list[Any]] | None
) -> dict[str, Any]:
    """The view after the newest drag on the figure, when it is not applied yet."""
    want = dict(view)
    if drag and drag.get("n") != view.get("drag"):  # a drag not applied yet
        want["drag"] = drag.get("n")
        picked = range_from_relayout(drag.get("relayout"), axis=view.get("axis", "step"), xmap=xmap)
        if picked is not False:
            want["from"], want["to"] = picked if picked is not None else (None, None)
    return want
