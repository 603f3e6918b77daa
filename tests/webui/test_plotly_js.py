"""The UI's plotly.js: the vendored partial bundle, and how the pages load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plotly.offline import get_plotlyjs_version

from trainwarden.webui import plotly_js
from trainwarden.webui.app import ASSETS, create_dash


def test_the_vendored_bundle_is_the_plotly_js_that_plotly_ships() -> None:
    # After upgrading plotly: npm pack plotly.js-cartesian-dist-min@<its plotly.js version>.
    assert get_plotlyjs_version() == plotly_js.VERSION
    header = (Path(ASSETS) / plotly_js.BUNDLE).read_text()[:200]
    assert f"plotly.js (cartesian - minified) v{plotly_js.VERSION}" in header


def test_pages_preload_the_bundle_and_do_not_block_on_it() -> None:
    client: Any = object()  # the page shell reads no data
    html = create_dash(client).server.test_client().get("/").get_data(as_text=True)
    url = f"/assets/{plotly_js.BUNDLE}"
    assert f'<link rel="preload" as="script" href="{url}">' in html
    assert f'<script src="{url}' not in html  # not one of the scripts every page waits for
    assert "window.Plotly = window.Plotly ||" in html
