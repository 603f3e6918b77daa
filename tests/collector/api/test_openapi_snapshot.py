"""The HTTP API does not change by accident: the app's OpenAPI document is compared with
the committed snapshot ``docs/reference/openapi.json`` (which the docs site renders as the
API reference). An intended change updates the snapshot in the same commit:

    .venv/bin/python -m tests.collector.api.test_openapi_snapshot
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine

from trainwarden.collector.app import create_app

SNAPSHOT = Path(__file__).resolve().parents[3] / "docs" / "reference" / "openapi.json"


def current() -> dict[str, Any]:
    app = create_app(
        create_engine("sqlite://"),
        ui=False,
        health=None,
        rollups=False,
        alerting=None,
        act=False,
        incidents=False,
    )
    return json.loads(json.dumps(app.openapi()))


def test_the_api_matches_its_committed_snapshot() -> None:
    saved = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    now = current()
    changed = sorted(
        {
            p
            for p in saved["paths"].keys() | now["paths"].keys()
            if saved["paths"].get(p) != now["paths"].get(p)
        }
    )
    assert not changed, f"the HTTP API changed at {changed}; if intended, rerun {__doc__}"
    assert saved == now, f"the API's schemas changed; if intended, rerun {__doc__}"


if __name__ == "__main__":
    SNAPSHOT.write_text(json.dumps(current(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {SNAPSHOT}")
