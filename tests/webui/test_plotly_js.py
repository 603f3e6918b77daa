"""The UI's plotly.js: the vendored partial bundle, and how the pages load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plotly.offline import get_plotlyjs_version

from trainwarden.webui import plotly_js, polyfill
from trainwarden.webui.app import ASSETS, create_dash


def test_the_vendored_bundle_is_the_plotly_js_that_plotly_ships() -> None:
    # After upgrading plotly: rebuild it from plotly.js@<its version> (webui/plotly_js.py).
    assert get_plotlyjs_version() == plotly_js.VERSION
    bundle = (Path(ASSETS) / plotly_js.BUNDLE).read_text()
    assert f"plotly.js (scatter-bar-heatmap - minified) v{plotly_js.VERSION}" in bundle[:200]
    assert "Licensed under the MIT license" in bundle[:200]
    assert f'.version="{plotly_js.VERSION}"' in bundle  # plotly.js's own src/version.js


def test_the_bundle_has_every_trace_type_the_ui_draws() -> None:
    # The pages draw scatter (overview, hardware, timeline, ranks detail), bar (run page)
    # and heatmap (ranks page) traces; each registers its module by name in the bundle.
    bundle = (Path(ASSETS) / plotly_js.BUNDLE).read_text()
    for trace in ("scatter", "bar", "heatmap"):
        assert f'moduleType:"trace",name:"{trace}"' in bundle, trace
    assert 'name:"scattergl"' not in bundle and 'name:"box"' not in bundle


def test_pages_preload_the_bundle_and_do_not_block_on_it() -> None:
    client: Any = object()  # the page shell reads no data
    html = create_dash(client).server.test_client().get("/").get_data(as_text=True)
    url = f"/assets/{plotly_js.BUNDLE}"
    assert f'<link rel="preload" as="script" href="{url}">' in html
    assert f'<script src="{url}' not in html  # not one of the scripts every page waits for
    assert "window.Plotly = window.Plotly ||" in html


def test_pages_load_regenerator_runtime_not_babel_polyfill() -> None:
    client: Any = object()
    html = create_dash(client).server.test_client().get("/").get_data(as_text=True)
    runtime = f'<script src="/assets/{polyfill.RUNTIME}"></script>'
    assert runtime in html and "polyfill@" not in html
    # Before React, where the polyfill was, and only there (not also as an asset).
    assert html.index(runtime) < html.index("/deps/react@") and html.count(polyfill.RUNTIME) == 1
    assert "regeneratorRuntime = runtime" in (Path(ASSETS) / polyfill.RUNTIME).read_text()
