"""A dead rank's last words at the collector (``rank_crashed``, ingest/crashes.py): stored
once under the dead rank, whoever sends it; only that kind may name another rank, within
the world; it is the verdict, the dead rank's reason, until the rank restarts."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from trainwarden.collector.app import create_app
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch

WORLD = 4
T0 = 1_700_000_100.0
CAUSE = "C++ exception gloo::EnforceNotMet: ... Received data size doesn't match expected size."


def crashed(rank: int, session: str, **data: Any) -> dict[str, Any]:
    return {
        "id": f"rank_crashed:{session}",
        "kind": "rank_crashed",
        "ts": T0,
        "step": 30,
        "severity": "critical",
        "rank": rank,
        "data": {
            "signal": "SIGABRT",
            "session": session,
            "collective": "all_reduce",
            "where": "train.py:88 in step_fn",
            "last_step": 30,
            "cause": CAUSE,
            "stack": [
                {
                    "file": "/x/torch/distributed/distributed_c10d.py",
                    "line": 1,
                    "function": "all_reduce",
                }
            ],
            **data,
        },
    }


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def test_a_crash_sent_by_two_survivors_is_stored_once_under_the_dead_rank(client) -> None:
    for rank in range(WORLD):
        assert client.post("/api/v1/ingest", json=batch(rank=rank, world_size=WORLD)).is_success
    with write(client.app.state.engine) as conn:  # the evaluator found rank 3 dead
        conn.execute(
            update(m.ranks)
            .where(m.ranks.c.rank == 3)
            .values(
                state="dead", state_detail={"role": "culprit", "reason": "no heartbeat for 5.0s"}
            )
        )
    for sender in (0, 1):
        body = batch(rank=sender, world_size=WORLD, events=[crashed(3, "session-3")])
        assert client.post("/api/v1/ingest", json=body).is_success
    events = client.get("/api/v1/runs/r1/events", params={"kind": "rank_crashed"}).json()
    assert [e["rank"] for e in events] == [3]
    view = client.get("/api/v1/runs/r1/collectives").json()
    verdict = view["verdict"]
    assert (verdict["kind"], verdict["culprits"], verdict["op"]) == ("crashed", [3], "all_reduce")
    assert verdict["summary"] == (
        "rank 3 (node node3) died of SIGABRT in all_reduce (train.py:88 in step_fn) "
        f"(last step seen: 30): {CAUSE}"
    )
    with client.app.state.engine.connect() as conn:
        detail = conn.execute(select(m.ranks.c.state_detail).where(m.ranks.c.rank == 3)).scalar()
    assert detail["reason"].startswith("died of SIGABRT") and CAUSE in detail["reason"]
    assert detail["silent"] == "no heartbeat for 5.0s" and detail["role"] == "culprit"
    # Rank 3 restarted (its row holds the new session): its old crash is history.
    with write(client.app.state.engine) as conn:
        conn.execute(update(m.ranks).where(m.ranks.c.rank == 3).values(session="s-3b"))
    assert client.get("/api/v1/runs/r1/collectives").json()["verdict"] is None


def test_only_a_crash_names_another_rank_and_within_the_world(client) -> None:
    start = {"id": "s1", "kind": "start", "ts": T0, "rank": 3}
    for event, why in ((start, "names no other rank"), (crashed(9, "s9"), "outside world_size")):
        response = client.post(
            "/api/v1/ingest", json=batch(rank=0, world_size=WORLD, events=[event])
        )
        assert response.status_code == 422 and why in response.text, response.text
    with client.app.state.engine.connect() as conn:
        assert conn.execute(select(m.events.c.id)).all() == []
