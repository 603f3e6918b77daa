"""The ranks page of a run, ``/runs/<name>/ranks``: rank x step heatmaps, rank states, one
rank's detail.

The URL holds what is shown: ``?rank=3&from=1200&to=1800`` (a rank's detail, a step
range). Clicking a heatmap cell or a rank in the table sets ``rank``; zooming a step
heatmap sets ``from``/``to`` and the collector re-buckets that range; a double-click
drops them. Each heatmap has its own callback; the step-time heatmap's runs first and the
others' after it (started together, four heatmaps share the server's cores and all draw
late; one at a time, the first draws in about a quarter of the time).

Its Collectives section (:mod:`.collectives_panel`) says which rank a hung job waits on, in
which collective: above the rank states (``#ranks-collectives``) while ranks are hung or
the verdict names a culprit, else at the bottom of the page (rings of a hang long over,
or one quiet line when there are none: above, they would push the heatmaps down on every
run that is fine). It refreshes with the rank states, and is redrawn only when what it
shows changed (its button is not replaced under the pointer).
"""

from __future__ import annotations

from typing import Any

from dash import dcc, html

from ...charts import placeholder
from ...components import notice, run_tabs
from . import collectives_panel as coll
from .data import HEATMAPS, HINT


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
            html.Div(id="ranks-preflight"),  # the checks before step 0, when the run ran them
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
