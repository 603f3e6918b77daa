"""Schemathesis over the collector's OpenAPI: every operation gets generated requests,
valid and not; none may answer 5xx (or raise), and every answer must match the schema
the API publishes. Runs on SQLite with a seeded run, so reads find rows too."""

from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Any

import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from trainwarden.collector.app import create_app
from trainwarden.collector.store.db import make_engine, upgrade

from ..helpers import batch, step

# Per operation. Derandomized: CI runs the same requests every time (a failure can be
# replayed); TRAINWARDEN_FUZZ_EXAMPLES=500 TRAINWARDEN_FUZZ_RANDOM=1 searches wider.
EXAMPLES = int(os.environ.get("TRAINWARDEN_FUZZ_EXAMPLES", "15"))
RANDOM = os.environ.get("TRAINWARDEN_FUZZ_RANDOM") == "1"
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


def test_no_operation_answers_5xx_or_off_its_schema(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'fuzz.db'}")
    upgrade(engine)
    app = create_app(engine, ui=False, health=None, rollups=False, alerting=None, act=False)
    with TestClient(app) as client:  # the app's threads run (the ingest writer) throughout
        body = batch("r1", rank=0, world_size=2, steps=[step(i) for i in range(20)])
        assert client.post("/api/v1/ingest", json=body).status_code == 200  # reads find rows
        fuzz_all(app)


def fuzz_all(app: Any) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[tuple[str, str]] = []
    cases: collections.Counter[str] = collections.Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 25  # the whole API, not an empty schema

    def fuzz(operation: Any) -> None:
        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=not RANDOM,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            cases[operation.label] += 1
            try:
                response = case.call()
            except Exception as exc:  # the app raised
                failures.append((operation.label, f"{type(exc).__name__}: {str(exc)[:300]}"))
                return
            try:
                case.validate_response(response, checks=CHECKS)
            except BaseException as exc:  # a failed check (a group of them): note it, go on
                if isinstance(exc, KeyboardInterrupt):
                    raise
                what = (
                    f"{case.method} {case.formatted_path} {case.query or ''} {str(case.body)[:200]}"
                )
                failures.append(
                    (operation.label, f"{response.status_code} {response.text[:300]} <- {what}")
                )

        run()

    for operation in operations:
        fuzz(operation)
    print(f"\nschemathesis: {sum(cases.values())} requests over {len(cases)} operations")
    first = {label: why for label, why in failures}
    assert not first, "\n".join(f"{label}: {why}" for label, why in first.items())
