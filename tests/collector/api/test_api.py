"""The HTTP API on a real database: every test runs on SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import os
import time

import pytest
from fastapi.testclient import TestClient

from trainwarden.collector.app import create_app
from trainwarden.collector.rollups.worker import flush

from ..helpers import batch, step


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    # No background threads: each test rolls steps up itself, at a known moment.
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def ingest(client: TestClient, body: dict) -> dict:
    response = client.post("/api/v1/ingest", json=body)
    assert response.status_code == 200, response.text
    flush(client.app.state.engine, now=time.time(), grace_s=0)
    return response.json()


def test_both_ranks_steps_roll_up_per_step(client: TestClient) -> None:
    ingest(
        client,
        batch(rank=0, steps=[step(0, loss=2.0, duration=0.10), step(1, loss=1.8, duration=0.10)]),
    )
    ingest(
        client,
        batch(rank=1, steps=[step(0, loss=2.4, duration=0.30), step(1, loss=1.6, duration=0.12)]),
    )

    loss = client.get("/api/v1/runs/r1/series", params={"metric": "loss"}).json()
    assert loss["step"] == [0, 1]
    assert loss["n"] == [2, 2]
    assert loss["min"] == [2.0, 1.6]
    assert loss["max"] == [2.4, 1.8]
    assert loss["median"] == pytest.approx([2.2, 1.7])

    step_time = client.get("/api/v1/runs/r1/series", params={"metric": "step_time"}).json()
    assert step_time["total"] == [0.30, 0.12]  # the job waits for its slowest rank
    assert step_time["argmax_rank"] == [1, 1]

    throughput = client.get("/api/v1/runs/r1/series", params={"metric": "tokens_per_s"}).json()
    assert throughput["total"] == pytest.approx([200 / 0.30, 200 / 0.12])


def test_a_run_not_heard_from_for_five_minutes_is_lost_until_a_rank_reports(
    client: TestClient,
) -> None:
    from sqlalchemy import update

    from trainwarden.collector.ingest import batches as ingest_module
    from trainwarden.collector.read.queries import LOST_AFTER_S
    from trainwarden.collector.store import models as m
    from trainwarden.collector.store.db import write

    for rank in (0, 1):
        ingest(client, batch(rank=rank, steps=[step(0)]))

    def shown() -> tuple[str, str, str]:
        (listed,) = client.get("/api/v1/runs").json()
        metrics = client.get("/metrics").text
        gauge = next(line for line in metrics.splitlines() if line.startswith("trainwarden_runs{"))
        return listed["status"], client.get("/api/v1/runs/r1").json()["status"], gauge

    assert shown() == ("running", "running", 'trainwarden_runs{status="running"} 1.0')
    silent_since = time.time() - LOST_AFTER_S - 5  # every rank silent since: the job died
    with write(client.app.state.engine) as conn:
        conn.execute(update(m.ranks).values(last_seen=silent_since))
        conn.execute(update(m.runs).values(updated_at=silent_since))
    assert shown()[:2] == ("lost", "lost")
    assert 'trainwarden_runs{status="lost"} 1.0' in client.get("/metrics").text
    # One rank reports again. (The run row is written at most once a second by this
    # process, which last wrote it a moment ago: the test moved its time back since.)
    ingest_module._run_touched.clear()
    ingest(client, batch(rank=1, steps=[step(1)]))
    assert shown() == ("running", "running", 'trainwarden_runs{status="running"} 1.0')


def test_run_detail_lists_ranks_and_status(client: TestClient) -> None:
    ingest(client, batch(rank=0, steps=[step(0)]))
    run = client.get("/api/v1/runs/r1").json()
    assert (run["world_size"], run["ranks_seen"], run["last_step"], run["status"]) == (
        2,
        1,
        0,
        "running",
    )
    assert run["ranks"][0]["host"] == "host0" and run["ranks"][0]["node"] == "node0"
    assert "loss" in run["metrics"]

    for rank in (0, 1):
        ingest(
            client,
            batch(
                rank=rank,
                steps=[step(1)],
                events=[{"id": f"s{rank}", "kind": "shutdown", "ts": 1_700_000_001.0, "step": 1}],
            ),
        )
    run = client.get("/api/v1/runs/r1").json()
    assert run["status"] == "finished"
    assert [r["state"] for r in client.get("/api/v1/runs/r1/ranks").json()] == [
        "finished",
        "finished",
    ]
    assert [r["name"] for r in client.get("/api/v1/runs").json()] == ["r1"]


def test_steps_run_again_replace_and_restart_is_an_event(client: TestClient) -> None:
    first = batch(rank=0, session="first", steps=[step(i, loss=3.0) for i in range(5)])
    first["agent"]["heartbeat_s"] = 0.05
    ingest(client, first)
    # The process dies (silent past 3 of its heartbeats: a restart, not a second live
    # process) and restarts from a checkpoint at step 3: steps 3 and 4 run again, later
    # (a later execution replaces the stored one).
    time.sleep(0.2)
    again = [{**step(i, loss=1.0), "ts": 1_700_000_100.0 + i} for i in range(3, 7)]
    ingest(client, batch(rank=0, session="second", steps=again))
    ingest(client, batch(rank=0, session="second", steps=again))  # a duplicate batch

    loss = client.get("/api/v1/runs/r1/series", params={"metric": "loss"}).json()
    assert loss["step"] == [0, 1, 2, 3, 4, 5, 6]
    assert loss["n"] == [1] * 7
    assert loss["max"] == [3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0]

    restarts = client.get("/api/v1/runs/r1/events", params={"kind": "restart"}).json()
    assert len(restarts) == 1
    assert restarts[0]["rank"] == 0
    assert restarts[0]["data"]["previous_session"] == "first"

    # The executions replaced (steps 3 and 4 the first time) are kept, once: the
    # duplicate batch replaced nothing more.
    replaced = client.get("/api/v1/runs/r1/replaced", params={"metric": "loss"}).json()
    assert (replaced["step"], replaced["n"], replaced["max"]) == ([3, 4], [1, 1], [3.0, 3.0])
    times = client.get(
        "/api/v1/runs/r1/replaced", params={"metric": "step_time", "points": 2}
    ).json()
    assert (times["unit"], times["step"], times["bucket"]) == ("s", [3, 4], 1)
    bad = client.get("/api/v1/runs/r1/replaced", params={"metric": "mfu"})
    assert bad.status_code == 422 and "known metrics: loss, grad_norm, step_time" in bad.text


def test_events_are_idempotent_by_id(client: TestClient) -> None:
    event = {"id": "e-1", "kind": "start", "ts": 1_700_000_000.0, "data": {"pid": 1}}
    assert ingest(client, batch(events=[event]))["accepted_events"] == 1
    assert ingest(client, batch(events=[event]))["accepted_events"] == 0
    assert len(client.get("/api/v1/runs/r1/events").json()) == 1


def test_non_finite_loss_is_stored_as_such_and_rolled_up_without_crashing(
    client: TestClient,
) -> None:
    ingest(client, batch(rank=0, steps=[step(0, loss="nan")]))
    ingest(client, batch(rank=1, steps=[step(0, loss=2.0)]))
    loss = client.get("/api/v1/runs/r1/series", params={"metric": "loss"}).json()
    assert loss["min"] == [2.0] and loss["max"] == [2.0]
    assert loss["n"] == [1]


def test_series_window_parameters(client: TestClient) -> None:
    ingest(client, batch(steps=[step(i) for i in range(10)]))

    def get(**params: object) -> list[int]:
        query = {"metric": "loss", **params}
        return client.get("/api/v1/runs/r1/series", params=query).json()["step"]

    assert get(last=3) == [7, 8, 9]
    assert get(**{"from": 2, "to": 4}) == [2, 3, 4]


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


def test_unknown_run_is_404_and_unknown_metric_is_422(client: TestClient) -> None:
    assert client.get("/api/v1/runs/nope").status_code == 404
    for path in (
        "ranks",
        "events",
        "series?metric=loss",
        "heatmap?metric=step_time",
        "ranks/0/series?metric=loss",
        "flags",
        "gpu",
    ):
        response = client.get(f"/api/v1/runs/nope/{path}")
        assert response.status_code == 404, path
        assert response.json()["detail"] == "run 'nope' not found", path
    ingest(client, batch(steps=[step(0)]))
    for path in ("ranks", "events", "series?metric=loss", "flags", "gpu"):
        assert client.get(f"/api/v1/runs/r1/{path}").status_code == 200, path
    response = client.get("/api/v1/runs/r1/series", params={"metric": "lossy"})
    assert response.status_code == 422
    body = response.json()
    assert body["error"].startswith("metric: unknown metric") and "known metrics" in body["error"]
    assert body["detail"][0]["loc"] == ["query", "metric"]


def test_healthz_metrics_and_openapi(client: TestClient) -> None:
    ingest(client, batch(steps=[step(0)]))
    client.post("/api/v1/ingest", json={"run": "x"})
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok", "pid": os.getpid()}
    text = client.get("/metrics").text
    assert 'trainwarden_ingest_requests_total{outcome="ok"} 1.0' in text
    assert 'trainwarden_ingest_requests_total{outcome="invalid"} 1.0' in text
    assert 'trainwarden_ingest_records_total{kind="step"} 1.0' in text
    assert 'trainwarden_runs{status="running"} 1.0' in text
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/api/v1/ingest",
        "/api/v1/runs",
        "/api/v1/runs/{run}",
        "/api/v1/runs/{run}/series",
    ):
        assert path in paths


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


def telemetry_step(n: int, *, rank: int, flags: list[str] | None = None) -> dict:
    return {
        **step(n, loss=2.0 + rank, duration=1.0),
        "grad_norm": 0.5 + rank,
        "fwd_s": 0.2,
        "bwd_s": 0.5,
        "opt_s": 0.2,
        "other_s": 0.1,
        "compute_s": 0.8 - 0.2 * rank,
        "exposed_comm_s": 0.2 + 0.2 * rank,
        "overlapped_comm_s": 0.3,
        "comm_source": "hook",
        "flops": 4e12,
        "mfu": 0.4,
        "peak_flops": 10e12,
        "flops_source": "given: flops_per_step",
        "peak_source": "given",
        "rss_bytes": 1 << 30,
        **({"flags": flags} if flags else {}),
    }


def test_step_telemetry_round_trips_per_rank_and_rolls_up(client: TestClient) -> None:
    for rank in (0, 1):
        steps = [
            telemetry_step(i, rank=rank, flags=["grad_norm_spike"] if (rank, i) == (1, 2) else None)
            for i in range(3)
        ]
        ingest(client, batch(rank=rank, steps=steps))

    def series(metric: str) -> dict:
        return client.get("/api/v1/runs/r1/series", params={"metric": metric}).json()

    assert series("mfu")["total"] == [pytest.approx(8e12 / 20e12)] * 3
    assert series("exposed_comm")["max"] == [pytest.approx(0.4)] * 3
    assert series("exposed_comm")["argmax_rank"] == [1, 1, 1]
    assert series("compute")["total"] == [pytest.approx(0.7)] * 3
    assert series("grad_norm")["max"] == [1.5] * 3
    assert series("rss")["max"] == [1 << 30] * 3

    # Each rank's own loss, as it reported it.
    for rank in (0, 1):
        own = client.get(f"/api/v1/runs/r1/ranks/{rank}/series", params={"metric": "loss"}).json()
        assert (own["rank"], own["step"], own["value"]) == (rank, [0, 1, 2], [2.0 + rank] * 3)

    flags = client.get("/api/v1/runs/r1/flags").json()
    assert flags == [
        {"step": 2, "rank": 1, "flags": ["grad_norm_spike"], "loss": 3.0, "grad_norm": 1.5}
    ]


def test_non_finite_grad_norm_is_kept_as_an_issue(client: TestClient) -> None:
    ingest(client, batch(steps=[{**step(0), "grad_norm": "inf", "flags": ["nonfinite_grad_norm"]}]))
    assert client.get("/api/v1/runs/r1/flags").json()[0]["grad_norm"] is None
    stats = client.get("/api/v1/runs/r1/series", params={"metric": "grad_norm"}).json()
    assert stats["n"] == [0] and stats["max"] == [None]


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


def test_downsampled_series_keeps_the_spike(client: TestClient) -> None:
    losses = [1.0] * 1000
    losses[637] = 50.0  # one spike in a thousand steps
    ingest(client, batch(steps=[step(i, loss=v) for i, v in enumerate(losses)]))
    full = client.get("/api/v1/runs/r1/series", params={"metric": "loss"}).json()
    assert full["bucket"] == 1 and len(full["step"]) == 1000
    small = client.get("/api/v1/runs/r1/series", params={"metric": "loss", "points": 100}).json()
    assert small["bucket"] == 10 and len(small["step"]) == 100
    assert max(small["max"]) == 50.0 and max(small["total"]) == 50.0
    assert small["step"][small["max"].index(50.0)] == 630  # the bucket that holds step 637
    assert full["p99"][637] == 50.0 and max(small["p99"]) == 50.0  # one rank: p99 is its value


def test_heatmap_shows_the_slow_rank_as_a_stripe(client: TestClient) -> None:
    for rank in range(4):
        ingest(
            client,
            batch(
                rank=rank,
                world_size=4,
                steps=[step(i, duration=0.3 if rank == 2 else 0.1) for i in range(100)],
            ),
        )
    heat = client.get(
        "/api/v1/runs/r1/heatmap", params={"metric": "step_time", "buckets": 10}
    ).json()
    assert (
        heat["ranks"] == [0, 1, 2, 3] and heat["bucket"] == 10 and heat["step_start"][:2] == [0, 10]
    )
    assert all(v == 0.3 for v in heat["values"][2]) and all(v == 0.1 for v in heat["values"][0])
    bad = client.get("/api/v1/runs/r1/heatmap", params={"metric": "tokens_per_s"})
    assert bad.status_code == 422 and "per-rank column" in bad.json()["error"]


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


def test_metrics_pass_promtool_and_carry_per_run_gauges(client: TestClient) -> None:
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail(
            "PROMTOOL MISSING: install Debian's prometheus package (scripts/test.sh does)",
            pytrace=False,
        )
    for rank in (0, 1):
        ingest(client, batch(rank=rank, steps=[telemetry_step(i, rank=rank) for i in range(3)]))
    client.post("/api/v1/ingest", json={"run": "x"})  # one refused request, counted
    text = client.get("/metrics").text
    for line in (
        'trainwarden_run_mfu{run="r1"} 0.4',  # 8e12 FLOPs / (1 s x 20e12)
        'trainwarden_run_step_time_seconds{run="r1",stat="max"} 1.0',
        'trainwarden_run_ranks{run="r1",state="healthy"} 2.0',
        'trainwarden_run_last_step{run="r1"} 2.0',
        "trainwarden_rollup_queue_depth 0.0",
        "trainwarden_ingest_queue_rows 0.0",  # everything above was committed
        'trainwarden_ingest_requests_total{outcome="ok"} 2.0',
        'trainwarden_ingest_records_total{kind="step"} 6.0',
    ):
        assert line in text, line
    assert "trainwarden_ingest_flush_requests_count " in text
    assert 'trainwarden_collector_thread_cpu_seconds_total{thread="main"} ' in text
    assert 'trainwarden_collector_thread_cpu_seconds_total{thread="writer"} ' in text
    p99 = float(text.split('trainwarden_run_step_time_seconds{run="r1",stat="p99"} ')[1].split()[0])
    assert 0.0 < p99 <= 1.0  # at most the max
    lag = float(text.split("\ntrainwarden_ingest_lag_seconds ")[1].split()[0])
    assert 0.0 <= lag < 5.0
    assert 'trainwarden_run_exposed_comm_ratio{run="r1"} 0.3' in text  # mean of 0.2 and 0.4
    check = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


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


def test_fastapi_native_telemetry_is_off_even_with_a_global_tracer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """FastAPI's native OpenTelemetry asks on every request whether a global provider is
    set (2 % of the collector's time under ingest load): the collector turns it off. In a
    process of its own (a global provider cannot be unset): a plain FastAPI app traces
    its request there, the collector's app does not."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        from fastapi import FastAPI
        from fastapi.testclient import TestClient
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from trainwarden.collector.app import create_app
        from trainwarden.collector.store.db import make_engine, upgrade

        spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        trace.set_tracer_provider(provider)
        plain = FastAPI()
        plain.get("/ping")(lambda: {"ok": True})
        with TestClient(plain) as c:
            assert c.get("/ping").status_code == 200
        control = len(spans.get_finished_spans())
        spans.clear()
        engine = make_engine("sqlite:///DB")
        upgrade(engine)
        with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
            assert c.get("/api/v1/runs").status_code == 200
        print(control, len(spans.get_finished_spans()))
        """
    ).replace("DB", str(tmp_path / "tw.db"))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    control, ours = map(int, done.stdout.split()[-2:])
    assert control > 0, "this FastAPI traces nothing natively: the test proves nothing"
    assert ours == 0
