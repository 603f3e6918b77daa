"""User metrics (``s.metric``) through ingest, rollup and series, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from trainwarden.collector.app import create_app
from trainwarden.collector.store import models as m

from ..helpers import batch, step
from ..helpers import ingest_rolled_up as ingest
from ..helpers import run_series as series


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def with_metrics(n: int, **metrics: Any) -> dict[str, Any]:
    return {**step(n), "metrics": metrics}


def test_user_metrics_roll_up_across_ranks(client: TestClient) -> None:
    values = {0: (1e-4, 0.50), 1: (1e-4, 0.20), 2: (1e-4, 0.90)}
    for rank, (lr, aux) in values.items():
        steps = [
            with_metrics(0, lr=lr, **{"moe.aux_loss": aux}),
            with_metrics(1, lr=lr / 2, **{"moe.aux_loss": aux + 1}),
        ]
        ingest(client, batch(rank=rank, world_size=3, steps=steps))

    aux = series(client, "user.moe.aux_loss")
    assert aux["step"] == [0, 1] and aux["n"] == [3, 3] and aux["unit"] == ""
    assert aux["min"] == pytest.approx([0.2, 1.2]) and aux["max"] == pytest.approx([0.9, 1.9])
    assert aux["median"] == pytest.approx([0.5, 1.5])
    assert aux["total"] == pytest.approx([1.6 / 3, 4.6 / 3])  # the mean over ranks
    assert aux["argmax_rank"] == [2, 2]
    assert series(client, "user.lr")["max"] == pytest.approx([1e-4, 5e-5])

    listed = client.get("/api/v1/runs/r1/metrics").json()
    assert listed["user"] == ["user.lr", "user.moe.aux_loss"] and "loss" in listed["builtin"]
    assert client.get("/api/v1/runs/r1").json()["metrics"][-2:] == listed["user"]
    assert client.get("/api/v1/runs/nope/metrics").status_code == 404


def test_a_nonfinite_user_metric_is_stored_marked_and_counted(client: TestClient) -> None:
    ingest(client, batch(rank=0, steps=[with_metrics(0, lr=0.1, eval_loss="nan")]))
    ingest(client, batch(rank=1, steps=[with_metrics(0, lr="inf", eval_loss=2.0)]))

    with client.app.state.engine.connect() as conn:
        c = m.rank_steps.c
        rows = conn.execute(select(c.rank, c.metrics, c.issues).order_by(c.rank)).all()
    assert rows[0].metrics == {"lr": 0.1, "eval_loss": None}
    assert rows[0].issues == {"user.eval_loss": "nan"}
    assert rows[1].issues == {"user.lr": "inf"}

    lr = series(client, "user.lr")
    assert lr["n"] == [1] and lr["max"] == [0.1] and lr["argmax_rank"] == [0]
    with client.app.state.engine.connect() as conn:
        s = m.step_stats.c
        nonfinite = dict(
            conn.execute(select(s.metric, s.nonfinite).where(s.metric.like("user.%"))).all()
        )
    assert nonfinite == {"user.lr": 1, "user.eval_loss": 1}


@pytest.mark.parametrize(
    ("metrics", "message"),
    [
        ({"Lr": 1.0}, "'Lr'"),
        ({"9lives": 1.0}, "'9lives'"),
        ({"a" * 33: 1.0}, "'" + "a" * 33 + "'"),
        ({f"m{i}": 1.0 for i in range(33)}, "33 user metrics: at most 32"),
        ({"lr": "fast"}, "steps[0].metrics.lr"),
    ],
)
def test_bad_user_metrics_are_a_422_naming_them(client: TestClient, metrics, message: str) -> None:
    response = client.post("/api/v1/ingest", json=batch(steps=[{**step(0), "metrics": metrics}]))
    assert response.status_code == 422
    assert message in response.json()["error"]
    assert client.get("/api/v1/runs").json() == []


def columns(ranks: range, steps: range, metrics: Any) -> dict[str, Any]:
    rows = [(r, s) for s in steps for r in ranks]
    return {
        "run": "r1",
        "world_size": len(ranks),
        "agents": [{"rank": r, "host": "node0", "session": f"s{r}"} for r in ranks],
        "steps": {
            "rank": [r for r, _ in rows],
            "step": [s for _, s in rows],
            "ts": [1_700_000_000.0 + s for _, s in rows],
            "duration_s": [0.5] * len(rows),
            "metrics": [metrics(r, s) for r, s in rows],
        },
    }


def test_columnar_user_metrics_and_a_replay_change_nothing(client: TestClient) -> None:
    body = columns(range(4), range(3), lambda r, s: {"lr": 0.1 * (s + 1), "aux": float(r)})
    ingest(client, body, "/api/v1/ingest/columns")
    before = series(client, "user.aux")
    assert before["n"] == [4, 4, 4] and before["max"] == [3.0] * 3 and before["median"] == [1.5] * 3
    assert series(client, "user.lr")["total"] == pytest.approx([0.1, 0.2, 0.3])

    ingest(client, body, "/api/v1/ingest/columns")  # the same batch again
    assert series(client, "user.aux") == before
    with client.app.state.engine.connect() as conn:
        assert len(conn.execute(select(m.rank_steps.c.step)).all()) == 12


def test_bad_columnar_user_metrics_name_the_row(client: TestClient) -> None:
    body = columns(
        range(4), range(2), lambda r, s: {"Bad": 1.0} if (r, s) == (1, 1) else {"ok": 1.0}
    )
    response = client.post("/api/v1/ingest/columns", json=body)
    assert response.status_code == 422
    assert "steps row 5: metrics: user metric name 'Bad'" in response.json()["error"]


def test_user_metric_heatmap_and_one_ranks_series(client: TestClient) -> None:
    # rank 2's aux loss runs high from step 4 on; rank 1 has a NaN at step 3
    for rank in range(3):
        steps = []
        for n in range(8):
            aux = 1.0 + rank / 10 + (5.0 if rank == 2 and n >= 4 else 0.0)
            steps.append(with_metrics(n, aux="nan" if (rank, n) == (1, 3) else aux))
        steps.append(step(8))  # a step without user metrics
        ingest(client, batch(rank=rank, world_size=3, steps=steps))

    heat = client.get("/api/v1/runs/r1/heatmap", params={"metric": "user.aux", "buckets": 3})
    assert heat.status_code == 200, heat.text
    body = heat.json()
    assert body["ranks"] == [0, 1, 2] and body["bucket"] == 3 and body["unit"] == ""
    assert body["step_start"] == [0, 3, 6]
    assert body["values"][0] == pytest.approx([1.0, 1.0, 1.0])  # step 8 has none: not a 0
    assert body["values"][1] == pytest.approx([1.1, 1.1, 1.1])  # the NaN is a gap, not a max
    assert body["values"][2] == pytest.approx([1.2, 6.2, 6.2])  # the bad rank is a stripe

    one = client.get("/api/v1/runs/r1/ranks/1/series", params={"metric": "user.aux"})
    assert one.status_code == 200, one.text
    values = one.json()["value"]
    assert one.json()["step"] == list(range(9))
    assert values[:3] == pytest.approx([1.1] * 3) and values[3] is None and values[8] is None

    for path in ("/api/v1/runs/r1/heatmap", "/api/v1/runs/r1/ranks/1/series"):
        response = client.get(path, params={"metric": "user.nope"})
        assert response.status_code == 422
        assert "unknown metric 'user.nope'" in response.json()["error"]
        assert "user.aux" in response.json()["error"]  # what the run does have


def test_unknown_metric_lists_the_runs_user_metrics(client: TestClient) -> None:
    ingest(client, batch(steps=[with_metrics(0, lr=0.1)]))
    for metric in ("user.nope", "lossy"):
        response = client.get("/api/v1/runs/r1/series", params={"metric": metric})
        assert response.status_code == 422
        body = response.json()
        assert body["error"].startswith(f"metric: unknown metric '{metric}'")
        assert "loss" in body["error"] and "user.lr" in body["error"]
        assert body["detail"][0]["loc"] == ["query", "metric"]


def test_downsampled_user_series_keeps_the_spike(client: TestClient) -> None:
    values = [1.0] * 1000
    values[637] = 50.0
    ingest(client, batch(steps=[with_metrics(i, aux=v) for i, v in enumerate(values)]))
    small = series(client, "user.aux", points=100)
    assert small["bucket"] == 10 and len(small["step"]) == 100
    assert max(small["max"]) == 50.0 and max(small["total"]) == 50.0
    assert small["step"][small["max"].index(50.0)] == 630


def test_steps_without_user_metrics_store_none(client: TestClient) -> None:
    ingest(client, batch(steps=[step(0), {**step(1), "metrics": {}}]))
    with client.app.state.engine.connect() as conn:
        assert conn.execute(select(m.rank_steps.c.metrics)).scalars().all() == [None, None]
    assert client.get("/api/v1/runs/r1/metrics").json()["user"] == []


def test_otlp_user_metrics_are_stored_as_the_native_ones(client: TestClient) -> None:
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    from trainwarden.agent.otlp import OtlpTransport

    user = {"lr": 1e-4, "eval.loss": "nan"}
    native = batch("native", steps=[with_metrics(0, **user)])
    assert client.post("/api/v1/ingest", json=native).status_code == 200
    transport = OtlpTransport("http://127.0.0.1:9", token=None, timeout_s=1.0)
    request = encode_metrics(transport.metrics_data(batch("otlp", steps=[with_metrics(0, **user)])))
    transport.close()
    response = client.post(
        "/v1/metrics",
        content=request.SerializeToString(),
        headers={"Content-Type": "application/x-protobuf"},
    )
    assert response.status_code == 200, response.text
    with client.app.state.engine.connect() as conn:
        c = m.rank_steps.c
        rows = conn.execute(select(c.metrics, c.issues).order_by(c.run_id)).all()
    assert rows[0] == rows[1]
    assert rows[0].metrics == {"lr": 1e-4, "eval.loss": None}
    assert rows[0].issues == {"user.eval.loss": "nan"}


def test_user_metric_rollups_in_sql_equal_the_python_ones(engine) -> None:  # type: ignore[no-untyped-def]
    """The SQL rollup (PostgreSQL: a column a metric) and the Python one (SQLite) agree
    on awkward data: metrics some ranks lack, nulls, NaN / Inf, ties, steps without any."""
    import random

    from trainwarden.collector.ingest.batches import ingest as store
    from trainwarden.collector.ingest.schemas import IngestBatch
    from trainwarden.collector.rollups.worker import _aggregate_here, _aggregate_in_db
    from trainwarden.collector.store.db import is_sqlite, write

    rng = random.Random(5)
    for rank in range(6):
        steps = []
        for i in range(10):
            user = {
                name: rng.choice([0.5, 0.5, rng.random(), -rng.random(), None, "nan", "-inf"])
                for name in ("lr", "aux.loss", "z")
                if rng.random() < 0.7 and i != 4
            }
            steps.append({**step(i), "metrics": user})
        body = batch(rank=rank, world_size=6, steps=steps)
        with write(engine) as conn:
            store(conn, batch=IngestBatch.model_validate(body))
    keys = [(1, i) for i in range(10)]
    with engine.connect() as conn:
        here, _ = _aggregate_here(conn, keys)
        there = here if is_sqlite(conn) else _aggregate_in_db(conn, keys)[0]
    user_here = sorted((s for s in here if s["metric"].startswith("user.")), key=_key)
    user_there = sorted((s for s in there if s["metric"].startswith("user.")), key=_key)
    assert len(user_here) > 20 and not any(s["step"] == 4 for s in user_here)
    assert any(s["nonfinite"] for s in user_here)
    assert _rounded(user_here) == _rounded(user_there)  # values within [-1, 1]


def _key(stat: dict[str, Any]) -> tuple[int, str]:
    return stat["step"], stat["metric"]


def _rounded(stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: round(v, 9) if isinstance(v, float) else v for k, v in s.items()} for s in stats]
