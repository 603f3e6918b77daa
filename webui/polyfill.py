"""Dash's @babel/polyfill swapped for the one part of it that Dash's bundles use.

Dash puts ``deps/polyfill@7.12.1.min.js`` (core-js 2 and regenerator-runtime, 99 KB) first
in every page, and Chromium evaluates it for ~50 ms (2 vCPU, quiet; regenerator-runtime alone:
6 ms) before React, on the way to the first drawn graph. The browsers the UI supports have
every core-js 2 feature natively (the bundles that could use ``setImmediate`` test for it
first); what they do not have is
``regeneratorRuntime``, a global that Dash's renderer, dcc and dash_table call for their
transpiled async functions. So the page loads regenerator-runtime alone (25 KB, vendored in
``assets/vendor/``, MIT licence in its header), in the polyfill's place. Should a Dash upgrade
rename the polyfill, the page keeps Dash's own scripts unchanged (a test notices).
"""

from __future__ import annotations

import re

import dash

RUNTIME = "vendor/regenerator-runtime-0.13.11.js"  # under the assets folder
IGNORE = r"^regenerator-runtime-.*\.js$"  # loaded in the polyfill's place, not as an asset
POLYFILL = re.compile(r'<script src="[^"]*/deps/polyfill@[^"]*"></script>')


def replace_babel_polyfill(app: dash.Dash) -> None:
    """Serve ``app``'s pages regenerator-runtime instead of @babel/polyfill (see the doc)."""
    app.config.assets_ignore = "|".join(p for p in (app.config.assets_ignore, IGNORE) if p)
    tag = f'<script src="{app.get_asset_url(RUNTIME)}"></script>'
    scripts = app._generate_scripts_html

    def generate_scripts_html() -> str:
        return POLYFILL.sub(lambda _: tag, scripts(), count=1)

    app._generate_scripts_html = generate_scripts_html  # type: ignore[method-assign]
