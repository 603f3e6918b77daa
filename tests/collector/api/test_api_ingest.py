"""What the ingest endpoints take and refuse, on SQLite and PostgreSQL: malformed bodies
named by their field, a node's ranks in one columnar request (headers as rows or as
columns), oversized bodies, and the hint to large runs without a relay."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from trainwarden.collector.app import create_app
from trainwarden.collector.rollups.worker import flush

from ..helpers import batch, step


@pytest.mark.parametrize(
    ("body_change", "field"),
    [
        (lambda b: b["steps"][0].update(duration_s="fast"), "steps[0].duration_s"),
        (lambda b: b["steps"][0].update(step=-1), "steps[0].step"),
        (lambda b: b["agent"].update(rank=5), "rank 5 is outside world_size 2"),
        (lambda b: b.update(run="no spaces allowed"), "run"),
        (lambda b: b["agent"].pop("session"), "agent.session"),
        (lambda b: b["steps"][0].update(ts=time.time() + 3 * 86400), "72 h in the future"),
    ],
)
def test_malformed_ingest_is_a_422_naming_the_field(
    client: TestClient, body_change, field: str
) -> None:
    body = batch(steps=[step(0)])
    body_change(body)
    response = client.post("/api/v1/ingest", json=body)
    assert response.status_code == 422
    assert field in response.json()["error"]
    # Nothing of a refused batch is stored.
    assert client.get("/api/v1/runs").json() == []


def test_ingest_answers_as_its_route_would(client: TestClient) -> None:
    # POSTs are answered by DirectIngest, past FastAPI's routing: the same body and the
    # same errors; anything else still goes to FastAPI.
    answer = client.post("/api/v1/ingest", json=batch(steps=[step(0), step(1)]))
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {"accepted_steps": 2, "accepted_events": 0, "commands": []}
    bad = client.post("/api/v1/ingest", content=b"{", headers={"content-type": "application/json"})
    assert bad.status_code == 422 and bad.json()["error"].startswith("body: body is not valid JSON")
    assert client.get("/api/v1/ingest").status_code == 405


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("exposed_comm_s", -0.1, "steps[0].exposed_comm_s"),
        ("mfu", "inf", "steps[0].mfu"),
        ("comm_source", "guess", "steps[0].comm_source"),
        ("flags", ["x"] * 17, "steps[0].flags"),
    ],
)
def test_bad_telemetry_fields_are_named(
    client: TestClient, field: str, value, message: str
) -> None:
    response = client.post("/api/v1/ingest", json=batch(steps=[{**step(0), field: value}]))
    assert response.status_code == 422
    assert message in response.json()["error"]


def columns_body(ranks: range, steps: range, **overrides: object) -> dict:
    rows = [(r, s) for s in steps for r in ranks]
    body = {
        "run": "node-batched",
        "world_size": 8,
        "agents": [
            {"rank": r, "host": "node7", "node": "node7", "session": f"s{r}"} for r in ranks
        ],
        "steps": {
            "rank": [r for r, _ in rows],
            "step": [s for _, s in rows],
            "ts": [1_700_000_000.0 + s for _, s in rows],
            "duration_s": [0.5] * len(rows),
            "loss": [2.0 + r / 10 for r, _ in rows],
        },
    }
    body.update(overrides)
    return body


def test_columnar_ingest_stores_a_nodes_ranks_in_one_request(client: TestClient) -> None:
    response = client.post("/api/v1/ingest/columns", json=columns_body(range(8), range(3)))
    assert response.status_code == 200, response.text
    assert response.json()["accepted_steps"] == 24
    flush(client.app.state.engine, now=time.time(), grace_s=0)
    loss = client.get("/api/v1/runs/node-batched/series", params={"metric": "loss"}).json()
    assert loss["n"] == [8, 8, 8] and loss["min"] == [2.0] * 3 and loss["max"] == [2.7] * 3
    assert len(client.get("/api/v1/runs/node-batched/ranks").json()) == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b["steps"]["loss"].pop(), "differ in length"),
        (lambda b: b["steps"].update(lossy=[1.0] * 24), "unknown step columns ['lossy']"),
        (lambda b: b["steps"].pop("duration_s"), "missing step columns ['duration_s']"),
        (lambda b: b["agents"].pop(), "ranks [7] that have no entry in agents"),
        (lambda b: b["steps"]["duration_s"].__setitem__(5, -1), "steps row 5"),
        (
            lambda b: b.update(
                extras=[
                    {
                        "run": "other",
                        "agent": {"rank": 1, "world_size": 8, "host": "n", "session": "s1"},
                    }
                ]
            ),
            "extras row 0: run 'other' is not this batch's 'node-batched'",
        ),
        (
            lambda b: b.update(
                extras=[
                    {
                        "run": "node-batched",
                        "agent": {"rank": 9, "world_size": 8, "host": "n", "session": "s1"},
                    }
                ]
            ),
            "rank 9 is outside world_size 8",
        ),
    ],
)
def test_bad_columnar_bodies_say_what_is_wrong(client: TestClient, change, message: str) -> None:
    body = columns_body(range(8), range(3))
    change(body)
    response = client.post("/api/v1/ingest/columns", json=body)
    assert response.status_code == 422
    assert message in response.json()["error"]
    assert client.get("/api/v1/runs").json() == []


def as_agent_columns(body: dict) -> dict:
    """``body`` with its ranks' headers sent column-wise (a list a field)."""
    agents = body.pop("agents")
    names = {k for a in agents for k in a}
    return {**body, "agent_columns": {k: [a.get(k) for a in agents] for k in sorted(names)}}


def test_headers_sent_as_columns_are_stored_as_rows_are(client: TestClient) -> None:
    now = time.time()
    extra = {
        "pid": 4242,
        "sent_at": now,
        "last_step": 2,
        "last_step_end": now - 0.1,
        "in_step": False,
        "heartbeat_s": 2.0,
        "local_rank": 3,
    }
    for run, columnar in (("as-rows", False), ("as-columns", True)):
        body = columns_body(range(8), range(3), run=run)
        for agent in body["agents"]:
            agent.update(extra)
        body["agents"][5]["node"] = None  # its host stands for its node
        if columnar:
            body = as_agent_columns(body)
        response = client.post("/api/v1/ingest/columns", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["accepted_steps"] == 24
    flush(client.app.state.engine, now=time.time(), grace_s=0)

    def seen(run: str) -> list[dict]:
        ranks = client.get(f"/api/v1/runs/{run}/ranks").json()
        return [
            {
                k: v
                for k, v in r.items()
                if k not in ("first_seen", "last_seen", "state_since", "clock_skew_s")
            }
            for r in ranks
        ]

    assert seen("as-columns") == seen("as-rows")
    assert len(seen("as-rows")) == 8 and seen("as-rows")[0]["pid"] == 4242
    series = [
        client.get(f"/api/v1/runs/{run}/series", params={"metric": "loss"}).json()
        for run in ("as-rows", "as-columns")
    ]
    assert series[0]["max"] == series[1]["max"] == [2.7] * 3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b["agent_columns"]["host"].pop(), "agent_columns differ in length"),
        (
            lambda b: b["agent_columns"]["rank"].__setitem__(2, 8),
            "agent_columns row 2: rank 8 is outside world_size 8",
        ),
        (
            lambda b: b["agent_columns"].update(
                sent_at=[time.time()] * 7 + [time.time() + 3 * 86400]
            ),
            "agent_columns row 7: sent_at: timestamp is 72 h in the future",
        ),
        (
            lambda b: b["agent_columns"]["host"].__setitem__(4, ""),
            "agent_columns.host[4]: String should have at least 1 character",
        ),
        (lambda b: b["agent_columns"].pop("session"), "agent_columns.session"),
        (lambda b: b.update(agents=[{"rank": 0, "host": "h", "session": "s"}]), "not both"),
        (lambda b: b.pop("agent_columns"), "no ranks"),
        (
            lambda b: b["agent_columns"]["rank"].__setitem__(7, 6),
            "ranks [7] that have no entry in agent_columns",
        ),
    ],
)
def test_bad_agent_columns_say_what_is_wrong(client: TestClient, change, message: str) -> None:
    body = as_agent_columns(columns_body(range(8), range(3)))
    change(body)
    response = client.post("/api/v1/ingest/columns", json=body)
    assert response.status_code == 422
    assert message in response.json()["error"], response.json()["error"]
    assert client.get("/api/v1/runs").json() == []


def test_a_refused_first_batch_leaves_no_stale_run(client: TestClient) -> None:
    body = columns_body(range(8), range(2))
    body["steps"]["duration_s"][3] = -1  # row 3 fails inside the transaction that creates the run
    assert client.post("/api/v1/ingest/columns", json=body).status_code == 422
    good = columns_body(range(8), range(2))
    assert client.post("/api/v1/ingest/columns", json=good).status_code == 200
    assert client.get("/api/v1/runs/node-batched").json()["ranks_seen"] == 8


def test_an_oversized_body_is_413_and_stores_nothing(engine) -> None:  # type: ignore[no-untyped-def]
    from trainwarden.collector.settings import Settings

    app = create_app(engine, Settings(max_body_bytes=4096), ui=False, health=None, rollups=False)
    with TestClient(app) as small:
        body = batch(steps=[step(i) for i in range(200)])
        response = small.post("/api/v1/ingest", json=body)
        assert response.status_code == 413
        assert "4,096-byte limit" in response.json()["error"]

        def chunks():  # no Content-Length: counted as it streams in
            payload = json.dumps(body).encode()
            for i in range(0, len(payload), 1000):
                yield payload[i : i + 1000]

        chunked = small.post(
            "/api/v1/ingest", content=chunks(), headers={"Content-Type": "application/json"}
        )
        assert chunked.status_code == 413
        assert small.get("/api/v1/runs").json() == []
        assert small.post("/api/v1/ingest", json=batch(steps=[step(0)])).status_code == 200


def test_a_large_run_with_no_relay_is_told_of_relays_once(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    for rank in (0, 1, 2):
        body = batch("big", rank=rank, world_size=512, steps=[step(0)])
        assert client.post("/api/v1/ingest", json=body).status_code == 200
    hints = [r.getMessage() for r in caplog.records if "relay" in r.getMessage()]
    assert len(hints) == 1 and "run big: 512 ranks" in hints[0], hints
    # A small run, or a batch a relay sends on its own, says nothing.
    client.post("/api/v1/ingest", json=batch("small", world_size=8, steps=[step(0)]))
    client.post(
        "/api/v1/ingest",
        json=batch("relayed", world_size=512, steps=[step(0)]),
        headers={"Via": "1.1 trainwarden-relay"},
    )
    assert len([r for r in caplog.records if "relay" in r.getMessage()]) == 1
