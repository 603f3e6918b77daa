"""Runs, ranks, events and series over the HTTP API on a real database (SQLite and
PostgreSQL): roll-ups per step, run status, steps run again, series windows and
downsampling, heatmaps, flags, and unknown runs and metrics."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from ..helpers import batch, step
from .api_helpers import ingest, telemetry_step


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
    assert bad.status_code == 422 and "known metrics: step_time, loss, grad_norm" in bad.text


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
