"""``GET /api/v1/runs/{run}/data``: a run's judged epochs (flagged where a warning was
raised), its realized data mixture against the declared one, and its newest data events
(SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, insert, select

from trainwarden.collector.app import create_app
from trainwarden.collector.health.evaluator import evaluate
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step

T0 = time.time() - 600
RUN = "r1"


@pytest.fixture
def api(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as client:
        for rank in range(2):
            body = batch(RUN, rank=rank, world_size=2, steps=[step(1)])
            assert client.post("/api/v1/ingest", json=body).status_code == 200
        yield client


def run_id(engine: Engine, name: str = RUN) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(m.runs.c.id).where(m.runs.c.name == name)).scalar_one())


def event(
    rid: int, kind: str, ts: float, data: dict[str, Any], *, step: int | None, rank: int | None
) -> dict[str, Any]:
    severity = "info" if kind in ("epoch_coverage", "attempt_start") else "warning"
    return {
        "uid": f"{kind}:{rid}:{ts}:{rank}",
        "run_id": rid,
        "rank": rank,
        "step": step,
        "ts": ts,
        "recv_ts": ts,
        "kind": kind,
        "severity": severity,
        "data": data,
    }


EPOCH_0 = {
    "epoch": 0,
    "dataset_size": 1000,
    "exact": True,
    "kept": 1000,
    "seen": 1000,
    "distinct": 1000,
    "duplicated": 0,
    "missing": 0,
    "out_of_range": 0,
    "duplicated_error": 0.0,
    "missing_error": 0.0,
    "first_duplicate_step": None,
    "duplicate_examples": [],
    "missing_examples": [],
    "ranks": "0-1",
    "steps": [0, 99],
    "allowance": 1.0,
    "missing_allowance": 1.0,
    "dropped": 0,
    "skipped_by_rollback": 0,
    "reason": "epoch 0: 1,000 of 1,000 samples trained on, 0 repeated, 0 never seen",
}
EPOCH_1 = {
    **EPOCH_0,
    "epoch": 1,
    "seen": 1000,
    "distinct": 990,
    "duplicated": 10,
    "missing": 10,
    "first_duplicate_step": 120,
    "duplicate_examples": [{"id": 17, "at": [[101, 0], [120, 1]]}],
    "missing_examples": [3, 4],
    "steps": [100, 199],
    "reason": "epoch 1: 990 of 1,000 samples trained on, 10 repeated, 10 never seen",
}
DUPLICATED = "epoch 1: 10 samples trained on more than once, the first at step 120"
DRIFT = "source code gave 26.0% of the tokens of steps 50-249, declared 30.0% (tolerance 6.0%)"


@pytest.fixture
def seeded(api: TestClient, engine: Engine) -> TestClient:
    rid = run_id(engine)
    events = [
        event(
            rid, "attempt_start", T0, {"data_mixture": {"web": 0.7, "code": 0.3}}, step=None, rank=0
        ),
        event(rid, "epoch_coverage", T0 + 10, EPOCH_0, step=99, rank=None),
        event(rid, "epoch_coverage", T0 + 20, EPOCH_1, step=199, rank=None),
        event(
            rid, "data_duplicated", T0 + 20, {**EPOCH_1, "reason": DUPLICATED}, step=120, rank=None
        ),
        event(
            rid,
            "data_mixture_drift",
            T0 + 30,
            {"source": "code", "reason": DRIFT},
            step=249,
            rank=None,
        ),
        event(
            rid,
            "duplicate_batch",
            T0 + 5,
            {"ranks": [0, 1], "reason": "same batch"},
            step=7,
            rank=None,
        ),
        # An agent may send an event of any kind: not the collector's finding, not shown.
        event(rid, "data_skipped", T0 + 40, {"epoch": 0, "reason": "mine"}, step=1, rank=0),
        event(rid, "epoch_coverage", T0 + 40, {"epoch": 9}, step=1, rank=1),
    ]
    # Steps 0-249 (the window is the newest 200: 50-249): rank 0 draws 700 web tokens a
    # step, rank 1 250 of code, and rank 0 50 of books on steps 50-99; before step 50,
    # 1,000 of web a step (outside the window).
    tokens = [
        {"run_id": rid, "step": s, "rank": r, "source": src, "ts": T0 + s, "tokens": n}
        for s in range(250)
        for r, src, n in (
            ((0, "web", 1000),)
            if s < 50
            else ((0, "web", 700), (1, "code", 250), *(((0, "books", 50),) if s < 100 else ()))
        )
    ]
    with write(engine) as conn:
        conn.execute(insert(m.events), events)
        conn.execute(insert(m.source_tokens), tokens)
    return api


def test_the_runs_epochs_mixture_and_data_events(seeded: TestClient) -> None:
    r = seeded.get(f"/api/v1/runs/{RUN}/data")
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["coverage"] == [
        {
            **EPOCH_1,
            "step": 199,
            "ts": T0 + 20,
            "duplicated_past": True,
            "skipped_past": False,
        },
        {**EPOCH_0, "step": 99, "ts": T0 + 10, "duplicated_past": False, "skipped_past": False},
    ]
    # 140,000 web + 50,000 code + 2,500 books = 192,500 tokens in steps 50-249.
    assert got["mixture"] == {
        "declared": {"web": 0.7, "code": 0.3},
        "realized": {"books": 0.013, "code": 0.2597, "web": 0.7273},
        "tokens": {"books": 2500, "code": 50000, "web": 140000},
        "window": [50, 249],
        "steps": 200,
        "tolerance": {"web": 0.14, "code": 0.06},
    }
    assert [(e["kind"], e["step"], e["ts"], e["severity"], e["reason"]) for e in got["events"]] == [
        ("data_mixture_drift", 249, T0 + 30, "warning", DRIFT),
        ("data_duplicated", 120, T0 + 20, "warning", DUPLICATED),
        ("duplicate_batch", 7, T0 + 5, "warning", "same batch"),
    ]
    assert got["events"][0]["data"] == {"source": "code", "reason": DRIFT}


def test_a_run_with_no_data_checks_and_an_unknown_run(api: TestClient) -> None:
    r = api.get(f"/api/v1/runs/{RUN}/data")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "coverage": [],
        "mixture": {
            "declared": None,
            "realized": {},
            "tokens": {},
            "window": None,
            "steps": 0,
            "tolerance": {},
        },
        "events": [],
    }
    missing = api.get("/api/v1/runs/no-such-run/data")
    assert missing.status_code == 404
    assert "no-such-run" in missing.text


def test_only_the_newest_50_data_events_newest_first(api: TestClient, engine: Engine) -> None:
    rid = run_id(engine)
    with write(engine) as conn:
        conn.execute(
            insert(m.events),
            [
                event(rid, "data_order_drift", T0 + i, {"reason": f"drift {i}"}, step=i, rank=None)
                for i in range(60)
            ],
        )
    got = api.get(f"/api/v1/runs/{RUN}/data").json()["events"]
    assert [e["step"] for e in got] == list(range(59, 9, -1))
    assert got[0]["reason"] == "drift 59"


def sampled(n: int, rank: int, ids: list[int]) -> dict[str, Any]:
    s = step(n)
    s.update(
        ts=T0 + n,
        samples_digest=f"{rank:04x}{n:012x}",
        samples_count=len(ids),
        samples_epoch=0,
        samples_kept=ids,
    )
    return s


def test_an_epoch_the_collector_judged_from_what_the_ranks_sent(engine: Engine) -> None:
    """Through ingest and the health evaluator: the answer reads its events as written."""
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as api:
        # 8 samples, 2 ranks: both ranks train on ids 2 and 3 at step 2; 6 and 7 never.
        sent = {0: [[0, 1], [2, 3]], 1: [[4, 5], [2, 3]]}
        for rank, ids in sent.items():
            end = {
                "id": f"end-{rank}",
                "kind": "epoch_end",
                "ts": T0 + 10,
                "step": 2,
                "data": {"epoch": 0, "last_step": 2, "dataset_size": 8, "kept": 8, "exact": True},
            }
            steps = [sampled(n, rank, ids[n - 1]) for n in (1, 2)]
            body = batch(RUN, rank=rank, world_size=2, steps=steps, events=[end])
            r = api.post("/api/v1/ingest", json=body)
            assert r.status_code == 200, r.text
        with write(engine) as conn:
            evaluate(conn, now=T0 + 100, settings=HealthSettings())
        got = api.get(f"/api/v1/runs/{RUN}/data").json()
    [epoch] = got["coverage"]
    assert {k: epoch[k] for k in ("epoch", "seen", "distinct", "duplicated", "missing")} == {
        "epoch": 0,
        "seen": 8,
        "distinct": 6,
        "duplicated": 2,
        "missing": 2,
    }
    assert epoch["exact"] and epoch["first_duplicate_step"] == 2 and epoch["steps"] == [1, 2]
    assert epoch["duplicate_examples"] == [
        {"id": 2, "at": [[2, 0], [2, 1]]},
        {"id": 3, "at": [[2, 0], [2, 1]]},
    ]
    assert epoch["missing_examples"] == [6, 7]
    assert epoch["duplicated_past"] and epoch["skipped_past"]
    assert epoch["reason"] == "epoch 0: 6 of 8 samples trained on, 2 repeated, 2 never seen"
    assert (epoch["allowance"], epoch["missing_allowance"]) == (1.0, 1.0)  # world 2 - 1
    assert sorted(e["kind"] for e in got["events"]) == ["data_duplicated", "data_skipped"]
