"""A live refresh waits for the user's hand: while a pointer button is held down on a
graph (a drag that selects a range, a box zoom, a click on its way), a page's refresh
ticks are held back in the browser (``assets/gestures.js`` follows the pointer from the
page's load), so no figure is redrawn under the gesture; the gesture's own callback
redraws when it ends, and later ticks go through again.

A page draws its graphs from a tick store instead of its ``dcc.Interval``:
``hold_while_pointing(app, "run-interval", "run-tick")``, with ``dcc.Store(id="run-tick")``
in its layout. A button held longer than :data:`HOLD_MAX_MS` (the pointer left the
window, an event was lost) no longer holds the refresh back.
"""

from __future__ import annotations

import dash
from dash import Input, Output

HOLD_MAX_MS = 30_000

HOLD_JS = (
    """function(n) {
    const p = window._twPointer;  // assets/gestures.js: the pointer, from the page's load
    if (p && p.down && Date.now() - p.down < """
    + str(HOLD_MAX_MS)
    + """) {
        p.held += 1;  // a refresh held back (tests read it)
        return window.dash_clientside.no_update;
    }
    return n;
}"""
)


def hold_while_pointing(app: dash.Dash, interval_id: str, tick_id: str) -> None:
    """Copy ``interval_id``'s ticks into the store ``tick_id``, but not while a pointer
    button is held down on a graph of the page."""
    app.clientside_callback(
        HOLD_JS,
        Output(tick_id, "data"),
        Input(interval_id, "n_intervals"),
        prevent_initial_call=True,
    )
