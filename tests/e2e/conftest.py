"""Fixtures the browser tests share (the browser itself is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A tab that records console errors and uncaught exceptions in ``page.errors``."""
    tab = browser.new_page(viewport={"width": 1280, "height": 1000})
    tab.errors = []
    tab.on("console", lambda msg: tab.errors.append(msg.text) if msg.type == "error" else None)
    tab.on("pageerror", lambda exc: tab.errors.append(str(exc)))
    yield tab
    tab.close()
