"""Fixtures of the action engine's tests: ``cluster`` makes a simulated run
(:class:`.helpers.Cluster`)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from trainwarden.collector.api.routes import actions as actions_api

from .helpers import Cluster


@pytest.fixture
def cluster(engine: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Makes a :class:`Cluster`; the API's clock is the newest cluster's."""
    made: list[Cluster] = []

    def make(policy: dict[str, Any] | None = None, **kwargs: Any) -> Cluster:
        made.append(Cluster(engine, policy, **kwargs))
        return made[-1]

    monkeypatch.setattr(actions_api, "time", SimpleNamespace(time=lambda: made[-1].now))
    yield make
    for c in made:
        c.actions.stop()
