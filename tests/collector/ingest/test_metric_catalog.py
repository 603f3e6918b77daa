"""The metric catalog (``trainwarden.agent.metric_catalog``) is what the wire schema, the
tables, the OTLP map, the rollups, the alerts and the UI's lists are made of; and the
learning rate, a built-in through it, from ingest to its series, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from trainwarden.agent import metric_catalog as catalog
from trainwarden.agent.otlp import STEP_METRICS
from trainwarden.alerts.metrics import METRICS
from trainwarden.collector.app import create_app
from trainwarden.collector.ingest.schema_steps import StepIn
from trainwarden.collector.read import user_metrics as user_metric_reads
from trainwarden.collector.rollups.aggregate import sql_of
from trainwarden.collector.rollups.worker import HEATMAP_COLUMNS
from trainwarden.collector.store import models as m
from trainwarden.webui import charts

from ..helpers import batch, step
from ..helpers import ingest_rolled_up as ingest
from ..helpers import run_series as series


def test_each_field_is_a_wire_field_a_column_and_a_gauge() -> None:
    names = [f.name for f in catalog.FIELDS]
    assert set(names) <= set(StepIn.model_fields)
    assert set(names) <= {c.name for c in m.rank_steps.columns}
    assert sorted(field for field, _ in STEP_METRICS.values()) == sorted(names)
    replaced = {f.name for f in catalog.FIELDS if f.replaced}
    assert replaced == {c.name for c in m.replaced_steps.columns} & set(names)
    assert [n for n in StepIn.model_json_schema()["required"]] == ["step", "ts", "duration_s"]


def test_each_metric_is_computed_in_python_and_sql_and_drawn_in_its_colour() -> None:
    assert list(METRICS) == [mt.name for mt in catalog.METRICS]
    for metric in catalog.METRICS:
        value, total = sql_of(METRICS[metric.name])
        assert value and total, metric.name
        if metric.color:
            assert charts.COLORS[metric.name] == metric.color
    assert set(HEATMAP_COLUMNS) == {mt.name for mt in catalog.METRICS if mt.heatmap}
    assert catalog.EXTRAS == ("lr",)


def test_the_api_reference_lists_every_metric() -> None:
    api = Path(__file__).resolve().parents[3] / "docs" / "api.md"
    line = next(x for x in api.read_text().splitlines() if "/series?metric=loss" in x)
    listed = line[line.index("Metrics: ") : line.index("; and the run's own")]
    assert listed.count("`") == 2 * len(catalog.METRICS), listed
    for metric in catalog.METRICS:
        assert f"`{metric.name}`" in listed, metric.name


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def test_the_learning_rate_is_stored_rolled_up_and_offered(client: TestClient) -> None:
    ingest(client, batch(rank=0, steps=[{**step(0), "lr": 1e-3}, {**step(1), "lr": "nan"}]))
    columns = {
        "run": "r1",
        "world_size": 2,
        "agents": [{"rank": 1, "local_rank": 1, "host": "h", "pid": 2, "session": "s1"}],
        "steps": {
            "rank": [1, 1],
            "step": [0, 1],
            "ts": [1_700_000_000.0, 1_700_000_001.0],
            "duration_s": [0.1, 0.1],
            "lr": [3e-3, 5e-4],
            "metrics": [{"lr": 7.0}, None],  # a user metric of the same name stays apart
        },
    }
    ingest(client, columns, "/api/v1/ingest/columns")

    with client.app.state.engine.connect() as conn:
        c = m.rank_steps.c
        rows = conn.execute(select(c.rank, c.step, c.lr, c.issues).order_by(c.rank, c.step)).all()
        offered = user_metric_reads.offered(conn, run_id=1)
        s = m.step_stats.c
        query = select(s.nonfinite).where(s.metric == "lr").order_by(s.step)
        nonfinite = conn.execute(query).scalars().all()
    assert [(r.rank, r.step, r.lr, r.issues) for r in rows] == [
        (0, 0, 1e-3, None),
        (0, 1, None, {"lr": "nan"}),  # non-finite: NULL, named in issues, as for the loss
        (1, 0, 3e-3, None),
        (1, 1, 5e-4, None),
    ]
    lr = series(client, "lr")
    assert lr["step"] == [0, 1] and lr["n"] == [2, 1] and nonfinite == [0, 1]
    assert lr["total"] == pytest.approx([2e-3, 5e-4])  # the mean over ranks
    assert lr["max"] == pytest.approx([3e-3, 5e-4]) and lr["argmax_rank"] == [1, 1]
    assert series(client, "user.lr")["max"] == [7.0]
    assert offered == ["lr", "user.lr"]  # the built-in first, then the run's own
    listed = client.get("/api/v1/runs/r1/metrics").json()
    assert "lr" in listed["builtin"] and listed["user"] == ["user.lr"]


def test_a_learning_rate_that_is_not_a_number_is_a_422_naming_it(client: TestClient) -> None:
    response = client.post("/api/v1/ingest", json=batch(rank=0, steps=[{**step(0), "lr": "fast"}]))
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith("steps[0].lr: Input should be a valid number")
