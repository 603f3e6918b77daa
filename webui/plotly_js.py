"""plotly.js for the UI: a custom bundle of the traces it draws, run while the first figure is made.

dcc.Graph fetches the full plotly.js (4.8 MB) when the first graph mounts, after the page's
first callbacks, and Chromium then spends ~0.8 s evaluating it (2 vCPU) on the way to the
first drawn graph. The UI draws scatter, bar and heatmap traces only: the bundle is plotly.js's
core (scatter, the cartesian axes, shapes, annotations, legend...) with the bar and heatmap
traces, nothing else (1.26 MB; Chromium evaluates it in ~0.2 s, the "cartesian" partial
bundle of 1.5 MB, with box, violin, contour, histograms, pie and world calendars, in ~0.4 s;
measured side by side, 2 vCPU). It is vendored in ``assets/vendor/`` (MIT licence, in its
header), built from the npm source package ``plotly.js@VERSION`` by ``webui/plotly_bundle.js``
(its comment says how), VERSION being the one that plotly's Python package ships (a test
checks). A trace type outside the bundle (box, histogram, scattergl, pie, maps) would not
draw: add it to ``webui/plotly_bundle.js`` and rebuild.

The page's head preloads the bundle (it downloads alongside Dash's own scripts), and
``window.Plotly`` starts as a promise of it: dcc.Graph draws with ``window.Plotly`` when it
is set (``Promise.resolve(window.Plotly || <fetch the full bundle>)``, and Promise.resolve
waits on a thenable), so the full bundle is never fetched. The bundle runs at the first idle
moment after the first graph asks for it (``requestIdleCallback``, 500 ms at most): by then
Dash has sent the page's first callbacks, and the server makes their figures while it runs.
Run in the page's head, it held the page's first callbacks up by its 0.2-0.4 s; run the
moment the graph asked, it still ran before Dash sent the figure's callback (Dash sends a
callback whose output is a graph once the graph is ready).
"""

from __future__ import annotations

import dash

VERSION = "4.1.1"
BUNDLE = f"vendor/plotly-scatter-bar-heatmap-{VERSION}.min.js"  # under the assets folder
# Not one of the assets Dash puts in every page as a blocking <script>: loaded async instead.
IGNORE = r"^plotly-.*\.js$"  # Dash matches it against the file's name
_HEAD = """
        <link rel="preload" as="script" href="{url}">
        <script>
            window.Plotly = window.Plotly || (function () {
                var loading = null;
                return {then: function (ok, fail) {
                    loading = loading || new Promise(function (done, failed) {
                        var s = document.createElement("script");
                        s.src = "{url}";
                        s.onload = function () { done(window.Plotly); };
                        s.onerror = function () { failed(new Error("cannot load " + s.src)); };
                        // At the first idle moment: after Dash has sent the callbacks that
                        // asked for a graph (their figures are made while this runs).
                        var run = function () { document.head.appendChild(s); };
                        if (window.requestIdleCallback) {
                            window.requestIdleCallback(run, {timeout: 500});
                        } else {
                            window.setTimeout(run, 0);
                        }
                    });
                    return loading.then(ok, fail);
                }};
            })();
        </script>"""


def install_partial_plotly(app: dash.Dash) -> None:
    """Load the partial bundle from the head of ``app``'s pages (see the module's doc)."""
    app.config.assets_ignore = "|".join(p for p in (app.config.assets_ignore, IGNORE) if p)
    head = _HEAD.replace("{url}", app.get_asset_url(BUNDLE))
    app.index_string = app.index_string.replace("{%css%}", "{%css%}" + head, 1)
