"""The ranks page of a run, ``/runs/<name>/ranks``: rank x step heatmaps, rank states, one
rank's detail.

The URL holds what is shown: ``?rank=3&from=1200&to=1800`` (a rank's detail, a step
range). Clicking a heatmap cell or a rank in the table sets ``rank``; zooming a step
heatmap sets ``from``/``to`` and the collector re-buckets that range; a double-click
drops them. Each heatmap has its own callback; the step-time heatmap's runs first and the
others' after it (started together, four heatmaps share the server's cores and all draw
late; one at a time, the first draws in about a quarter of the time).

Its Collectives section (:mod:`.collectives`) says which rank a hung job waits on, in
which collective: above the rank states (``#ranks-collectives``) while ranks are hung or
the verdict names a culprit, else at the bottom of the page (rings of a hang long over,
or one quiet line when there are none: above, they would push the heatmaps down on every
run that is fine). It refreshes with the rank states, and is redrawn only when what it
shows changed (its button is not replaced under the pointer).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

import dash
from dash import ALL, Input, Output, State, dcc, html
from plotly.io.json import to_json_plotly

from trainwarden.collector.read.queries import NotFound

from ... import components
from ...charts import empty_figure, placeholder, themed
from ...client import Client, Refused, may_change
from ...components import is_default_pick, notice, parse_user, run_tabs
from ...first_graph import after_first
from ...gestures import hold_while_pointing
from . import collectives_panel as coll
from . import figures as rf
from .replicas_panel import strips as replica_strips

log = logging.getLogger(__name__)
BUCKETS = 200  # heatmap columns; the collector buckets the steps
GPU_SAMPLES = 20_000  # newest GPU readings read for the temperature heatmap
DETAIL_STEPS = 5_000  # one rank's detail: the newest steps when no range is chosen
HEATMAPS = ("step_time", "exposed_comm", "loss_dev", "gpu_temp")
STEP_HEATMAPS = HEATMAPS[:3]
HINT = html.P(
    "Click a heatmap cell or a rank number for that rank's detail. Drag across a step "
    "heatmap to zoom into those steps; double-click to see the whole run. The address bar "
    "keeps the rank and the range: share it.",
    className="hint",
)
TITLES = {
    "step_time": "Step time",
    "exposed_comm": "Exposed communication",
    "loss_dev": "Loss deviation from the median rank",
    "gpu_temp": "GPU temperature (by time)",
}


# -- the query string ----------------------------------------------------------


def parse_query(search: str | None) -> tuple[int | None, int | None, int | None]:
    """``(rank, from_step, to_step)`` from ``?rank=3&from=100&to=200``; what is not a
    whole number is ignored (a hand-edited URL still shows the page)."""
    query = parse_qs((search or "").lstrip("?"))

    def number(key: str) -> int | None:
        text = (query.get(key) or [""])[0].strip()
        return int(text) if text.lstrip("-").isdigit() else None

    lo, hi = number("from"), number("to")
    if lo is not None and hi is not None and hi < lo:
        lo, hi = hi, lo
    return number("rank"), lo, hi


def query_string(
    rank: int | None, lo: int | None, hi: int | None, *, user: str | None = None
) -> str:
    shown = None if user is None else user.removeprefix("user.")
    pairs = [
        (k, v)
        for k, v in (("rank", rank), ("from", lo), ("to", hi), ("user", shown))
        if v is not None
    ]
    return "?" + urlencode(pairs) if pairs else ""


def range_from_relayout(relayout: dict[str, Any] | None) -> tuple[int | None, int | None] | None:
    """The step range a zoom chose; ``(None, None)`` for a reset; None: not an x zoom."""
    if not relayout:
        return None
    if relayout.get("xaxis.autorange"):
        return None, None
    lo, hi = relayout.get("xaxis.range[0]"), relayout.get("xaxis.range[1]")
    if lo is None and isinstance(relayout.get("xaxis.range"), list):
        lo, hi = relayout["xaxis.range"]
    if lo is None or hi is None:
        return None
    return max(0, int(float(lo))), int(float(hi)) + 1


def clicked_rank(click: dict[str, Any] | None) -> int | None:
    try:
        return int(round(float(click["points"][0]["y"])))  # type: ignore[index]
    except (TypeError, KeyError, IndexError, ValueError):
        return None


# -- what the page draws ---------------------------------------------------------


def heatmap_part(client: Client, name: str, key: str, search: str | None, theme: str | None) -> Any:
    """One of the page's heatmaps (``key`` in HEATMAPS) as a figure."""
    rank, lo, hi = parse_query(search)
    title = TITLES[key]
    revision = f"{name}:{key}"
    if key == "gpu_temp":
        grid = rf.gpu_grid(client.gpu(name, limit=GPU_SAMPLES))
        return rf.heatmap_figure(
            grid,
            title=title,
            theme=theme,
            revision=revision,
            x_title="time",
            selected=rank,
            empty="No GPU temperatures: the agents report none "
            "(no NVML on their hosts). Other heatmaps are unaffected.",
        )
    metric = "loss" if key == "loss_dev" else key
    grid = rf.grid_of(client.heatmap(name, metric, buckets=BUCKETS, from_step=lo, to_step=hi))
    if key == "loss_dev":
        if len(grid.ranks) == 1:
            return themed(empty_figure("One rank: no peers to compare its loss with."), theme)
        grid = rf.deviation(grid)
        empty = "No loss yet: the trainer reports it with s.loss(value)."
        return rf.heatmap_figure(
            grid,
            title=title,
            theme=theme,
            revision=revision,
            selected=rank,
            diverging=True,
            empty=empty,
        )
    title = _stands_out(title, rf.stripes(grid))
    empty = (
        "No exposed-communication times: the agent splits communication when "
        "torch.distributed is initialised (comm split)."
        if key == "exposed_comm"
        else "No steps yet: the heatmap fills as the ranks report."
    )
    return rf.heatmap_figure(
        grid, title=title, theme=theme, revision=revision, selected=rank, empty=empty
    )


def _stands_out(title: str, found: list[tuple[int, float]]) -> str:
    """A heatmap's title naming the ranks whose row stands out."""
    if not found:
        return title
    return title + " · stands out: " + ", ".join(f"rank {r} ({x:.1f}× its peers)" for r, x in found)


USER_EMPTY = (
    "No user metrics in this run: log your own inside the step with s.metric(name, value) "
    "(an MoE router's load, an eval loss) and pick one here."
)


def user_choices(
    client: Client, name: str, search: str | None
) -> tuple[list[dict[str, str]], str | None]:
    """:func:`.components.user_choices` with the pick of the page's URL."""
    return components.user_choices(client, name, parse_user(search))


def user_heatmap_part(
    client: Client, name: str, metric: str | None, search: str | None, theme: str | None
) -> Any:
    """The chosen user metric (else the run's first) per rank and step bucket (the max
    per cell)."""
    rank, lo, hi = parse_query(search)
    if not metric:
        names = client.user_metrics(name)
        if not names:
            return themed(empty_figure(USER_EMPTY), theme)
        metric = names[0]
    grid = rf.grid_of(client.heatmap(name, metric, buckets=BUCKETS, from_step=lo, to_step=hi))
    title = f"User metric {metric.removeprefix('user.')} (max per cell)"
    # "x times its peers" means something for a metric that cannot go below zero only.
    positive = all(v is None or v >= 0 for row in grid.values for v in row)
    title = _stands_out(title, rf.stripes(grid) if positive else [])
    return rf.heatmap_figure(
        grid,
        title=title,
        theme=theme,
        revision=f"{name}:user:{metric}",
        selected=rank,
        empty=f"No values of {metric} in these steps.",
    )


def panels(
    client: Client, name: str, search: str | None, theme: str | None, *, run: Any = None
) -> tuple[Any, Any, Any]:
    """(notice, rank states, the selected rank's detail); ``run``: the run, if read."""
    rank, lo, hi = parse_query(search)
    run = run or client.get_run(name)
    note = None
    if run.last_step is None:
        note = notice(f"Run {name!r} has no steps yet: the heatmaps fill as its ranks report.")
    elif len(run.ranks) == 1:
        note = notice("This run has one rank: there are no peers to compare it with.")
    keep = query_string(None, lo, hi, user=parse_user(search)).lstrip("?")
    states = rf.states_table(name, run.ranks, selected=rank, keep=keep)
    if rank is None:
        return note, states, HINT
    info = next((r for r in run.ranks if r.rank == rank), None)
    if info is None:
        known = f"ranks {run.ranks[0].rank}–{run.ranks[-1].rank}" if run.ranks else "no ranks yet"
        return (
            note,
            states,
            notice(f"Rank {rank} has not reported in run {name!r} ({known}).", "error"),
        )
    last = None if lo is not None or hi is not None else DETAIL_STEPS
    mine = client.rank_series(name, rank, "step_time", from_step=lo, to_step=hi, last=last)
    everyone = client.series(name, "step_time", points=1_000, from_step=lo, to_step=hi, last=last)
    gpu = client.gpu(name, rank=rank, limit=1)
    events = [e for e in client.events(name) if e.rank == rank]
    figure = rf.rank_figure(mine, everyone, theme=theme, revision=f"{name}:rank")
    base = f"/runs/{quote(name, safe='')}"
    clear = dcc.Link("close", href=f"{base}/ranks{'?' + keep if keep else ''}")
    hardware = dcc.Link("its GPU", href=f"{base}/hardware?rank={rank}")
    return (
        note,
        states,
        html.Div(
            [
                html.H3(
                    [
                        f"Rank {rank}",
                        html.Span(" · ", className="fact-key"),
                        hardware,
                        html.Span(" · ", className="fact-key"),
                        clear,
                    ]
                ),
                rf.rank_facts(info, gpu[-1] if gpu else None, events),
                dcc.Graph(id="ranks-rank-graph", figure=figure, config={"displaylogo": False}),
            ],
            className="rank-detail",
        ),
    )


def collectives_part(client: Client, name: str, *, hung: int) -> tuple[Any, Any]:
    """(above the rank states, at the bottom of the page): the verdict on the ranks'
    Flight Recorder rings, or one line saying there are none yet (with a button for a
    session that may ask the ranks for them), in one of the two; ``hung``: how many of
    the run's ranks are hung now."""
    return coll.placed(client.collectives(name), hung=hung, may_change=may_change())


def read_collectives(client: Client, name: str) -> tuple[str, str]:
    """Ask every rank of the run for its collectives; (message, notice kind)."""
    try:
        asked = client.request_collectives(name, by="ui")
    except Refused as exc:
        return f"Not asked: {exc}.", "error"
    ranks = asked.get("ranks")
    who = "its ranks"
    if isinstance(ranks, int):
        who = "its only rank" if ranks == 1 else f"its {ranks:,} ranks"
    return (
        f"Asked {who} for their collectives: each answers with its next report (a few "
        "seconds; a rank whose process is gone never does, and is named so).",
        "info",
    )


# -- the page --------------------------------------------------------------------


def layout(name: str, search: str | None, *, refresh_s: float) -> html.Div:
    graph: dict[str, Any] = {"config": {"displaylogo": False}, "figure": placeholder("Loading…")}
    return html.Div(
        [
            # The page's own view of the URL: writing ?rank= / from / to does not reload.
            # With the query string the page was opened with, it reports no change when it
            # mounts: the rank states wait for the first heatmap (see first_graph).
            dcc.Location(id="ranks-url", refresh=False, search=search or ""),
            dcc.Store(id="ranks-run", data=name),
            html.H2(name),
            run_tabs(name, "Ranks"),
            html.Div(id="ranks-notice", role="status"),
            html.Div(id=coll.ANCHOR, className="coll-section"),
            html.Div(id="ranks-coll-feedback-top", role="status"),
            html.Div(id="ranks-states", className="ranks-panel", children=notice("Loading ranks…")),
            html.Div(id="ranks-detail", children=HINT),
            *[dcc.Graph(id=f"ranks-{key}", **graph) for key in HEATMAPS],
            # The user metric's picker and heatmap are made once the built-in heatmaps are
            # drawn: a fifth graph (and its placeholder) at load slowed the first heatmap.
            html.Div(id="ranks-user-box"),
            html.Div(id="ranks-coll-bottom", className="coll-section"),
            html.Div(id="ranks-replicas"),  # replica agreement (silent data corruption)
            html.Div(id="ranks-coll-feedback-bottom", role="status"),
            dcc.Store(id="ranks-coll-digest"),  # what the section shows: redrawn on a change
            dcc.Store(id="ranks-coll-changed", data=0),  # a request was made: read again now
            dcc.Store(id="ranks-coll-scrolled"),  # the address #ranks-collectives was scrolled to
            dcc.Store(id="ranks-heat-drawn"),  # the first heatmap is drawn: draw the others
            dcc.Store(id="ranks-heat-done"),  # and the last: draw the user metric's
            dcc.Store(id="ranks-first"),  # set once the first heatmap is back
            dcc.Store(id="ranks-gestures"),  # clicks and zooms on the heatmaps: see follow
            dcc.Store(id="ranks-user-gestures"),  # and on the user metric's
            dcc.Store(id="ranks-gesture-applied"),  # the newest gesture in the URL
            dcc.Store(id="ranks-heat-tick"),  # the heatmaps' refresh ticks: see gestures
            # Heatmaps of a big run are large: they refresh less often than the states.
            dcc.Interval(id="ranks-interval", interval=int(refresh_s * 1000)),
            dcc.Interval(id="ranks-heat-interval", interval=int(max(refresh_s * 2.5, 5) * 1000)),
        ]
    )


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

    # The page's first call of the callbacks below waits for the first heatmap.
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
            return panels(client, name, search, theme, run=run)

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


def apply_gestures(
    search: str | None, stores: list[Any], applied: int | None
) -> tuple[str, int | None]:
    """The URL after the gestures in ``stores`` numbered above ``applied``, oldest first
    (a click sets the rank, a zoom the step range, a double-click drops it), and the
    number of the newest gesture applied."""
    rank, lo, hi = parse_query(search)
    last = applied
    gestures = [g for store in stores if store for g in store.get("list") or []]
    for gesture in sorted(gestures, key=lambda g: g.get("n", 0)):
        n = gesture.get("n")
        if not isinstance(n, int) or (applied is not None and n <= applied):
            continue
        last = n if last is None else max(last, n)
        if "rank" in gesture:
            picked = clicked_rank({"points": [{"y": gesture["rank"]}]})
            if picked is not None:
                rank = picked
        else:
            chosen = range_from_relayout(gesture.get("relayout"))
            if chosen is not None:
                lo, hi = chosen
    return query_string(rank, lo, hi, user=parse_user(search)), last


def _has_picker(children: Any) -> bool:
    """Whether the user box's children (Dash's JSON of them) hold the picker."""
    return "ranks-user-metric" in str(children)


__all__ = ["apply_gestures", "layout", "parse_query", "parse_user", "query_string", "register"]
