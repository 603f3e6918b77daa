"""Fixtures the end-to-end tests share (the browser itself is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..helpers import database_url


@pytest.fixture
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An end-to-end test runs on one database, which it names:
    ``@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)`` (or ``"postgres"``;
    ``live_server`` takes it too). The store's behaviour on both is tested in
    tests/collector; a drill run twice would double the suite's longest tests for it."""
    if not hasattr(request, "param"):
        pytest.fail(
            f"{request.node.nodeid}: an end-to-end test names its database: "
            '@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True) or "postgres"',
            pytrace=False,
        )
    yield from database_url(request, tmp_path)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A tab that records console errors and uncaught exceptions in ``page.errors``."""
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    tab.errors = []
    tab.on("console", lambda msg: tab.errors.append(msg.text) if msg.type == "error" else None)
    tab.on("pageerror", lambda exc: tab.errors.append(str(exc)))
    yield tab
    tab.close()
