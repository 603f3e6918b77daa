"""A page's first graph before the rest of the page.

Dash holds a callback back while another callback whose output is a component's
``children`` is on its way (the new children might hold that callback's inputs). A page
whose header (alerts, notices, rank states) is made by such a callback fired at load
beside the figure's sends the figure's request only once the header is back: on a run of
1,024 ranks the overview's figure went out ~0.35 s later for it (measured in Chromium).
The header's first call waits for the figure instead: :func:`after_first`. (The other
two waits on the way to a first graph, the routing callback and plotly.js, are in
``app.layout`` and :mod:`.plotly_js`.)
"""

from __future__ import annotations

import dash
from dash import Input, Output, State

FIRST_JS = """function(_value, seen) {
    return seen ? window.dash_clientside.no_update : true;
}"""


def after_first(app: dash.Dash, trigger: tuple[str, str], flag_id: str) -> None:
    """Set the store ``flag_id`` to true the first time ``trigger`` (component id,
    property) is set, and never again: a callback that takes ``Input(flag_id, "data")``
    with ``prevent_initial_call=True`` makes its first call after the trigger's. Put
    ``dcc.Store(id=flag_id)`` in the page's layout."""
    app.clientside_callback(
        FIRST_JS,
        Output(flag_id, "data"),
        Input(*trigger),
        State(flag_id, "data"),
        prevent_initial_call=True,
    )
