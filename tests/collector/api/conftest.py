"""Fixtures of the HTTP API's tests: ``client``, a TestClient of the collector's app on
the test database (SQLite and PostgreSQL), without background threads."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from trainwarden.collector.app import create_app


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    # No background threads: each test rolls steps up itself, at a known moment.
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c
