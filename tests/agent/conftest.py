"""The agent tests' fixtures."""

from __future__ import annotations

import pytest

import trainwarden.agent as tw


@pytest.fixture
def clean_agent(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """The test starts without a launcher's identity in its environment and ends with the
    agent shut down (``pytestmark = pytest.mark.usefixtures("clean_agent")``)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRAINWARDEN_URL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)
