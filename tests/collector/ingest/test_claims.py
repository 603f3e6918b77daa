"""Two processes claiming one rank (collector/ingest/claims.py): while the holder is
alive, the second is refused (409, a rank_conflict event) and never overwrites the
holder's steps; a holder that said goodbye, or fell silent past its window, was
restarted, as before. On SQLite and PostgreSQL, through store_many and the HTTP API."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select

from trainwarden.collector.app import create_app
from trainwarden.collector.ingest.batches import store_many
from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schemas import IngestBatch, IngestResult
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step

T0 = 1_700_000_000.0  # the holder's process started here; arrivals are T0 + seconds


def claimant(
    session: str,
    *,
    started: float,
    steps: range = range(0),
    loss: float = 1.0,
    rank: int = 0,
    heartbeat_s: float = 1.0,
    pid: int = 1000,
    host: str = "host-a",
    events: list[dict[str, Any]] | None = None,
) -> IngestBatch:
    body = batch(rank=rank, session=session, steps=[step(n, loss=loss) for n in steps])
    body["agent"].update(started_at=started, heartbeat_s=heartbeat_s, pid=pid, host=host)
    body["agent"]["node"] = host
    body["events"] = events or []
    return IngestBatch.model_validate(body)


def send(engine: Engine, *batches: IngestBatch | ColumnarBatch, at: float) -> list[IngestResult]:
    """The batches stored in one flush, as arrived at ``T0 + at``."""
    with write(engine) as conn:
        return store_many(conn, list(batches), now=T0 + at, arrived=[T0 + at] * len(batches))


def stored(engine: Engine, rank: int = 0) -> dict[str, Any]:
    """The rank's holder, its steps' losses and the run's restart and conflict events."""
    with engine.connect() as conn:
        holder = conn.execute(
            select(m.ranks.c.session, m.ranks.c.pid).where(m.ranks.c.rank == rank)
        ).one()
        s, e = m.rank_steps.c, m.events.c
        losses = dict(
            conn.execute(select(s.step, s.loss).where(s.rank == rank).order_by(s.step)).all()
        )
        events = conn.execute(select(e.kind, e.rank, e.data).order_by(e.id)).all()
    return {
        "session": holder.session,
        "pid": holder.pid,
        "losses": losses,
        "restarts": [ev.data for ev in events if ev.kind == "restart"],
        "conflicts": [ev for ev in events if ev.kind == "rank_conflict"],
    }


def test_a_second_live_process_is_refused_and_named_and_the_holders_steps_stay(
    engine: Engine,
) -> None:
    send(engine, claimant("a", started=T0, steps=range(5), loss=1.0), at=100)
    # Another job's rank 0 (started at T0 + 99.5, before the holder's last request at
    # T0 + 100) sends its steps 0-2: both processes are alive.
    second = claimant("b", started=T0 + 99.5, steps=range(3), loss=9.0, pid=2000, host="host-b")
    (result,) = send(engine, second, at=100.5)

    assert result.accepted_steps == 0 and result.refusal is not None
    assert result.refusal["status"] == 409 and result.refusal["reason"] == "rank_conflict"
    assert result.refusal["holder"] == {
        "pid": 1000,
        "host": "host-a",
        "node": "host-a",
        "session": "a",
    }
    assert "pid 1000 on host-a" in result.refusal["detail"]
    after = stored(engine)
    assert after["session"] == "a" and after["pid"] == 1000  # the holder keeps the rank
    assert after["losses"] == {n: 1.0 for n in range(5)}  # none replaced by the second's 9.0
    assert after["restarts"] == []
    (event,) = after["conflicts"]
    first, other = event.data["first"], event.data["second"]
    assert (first["pid"], first["host"], first["session"]) == (1000, "host-a", "a")
    assert (other["pid"], other["host"], other["session"]) == (2000, "host-b", "b")
    assert other["first_seen"] == T0 + 99.5
    assert "pid 1000 on host-a" in event.data["reason"]
    assert "pid 2000 on host-b" in event.data["reason"]

    # It sends again: refused again, one event for the pair; the holder goes on.
    (again,) = send(engine, second, at=101)
    send(engine, claimant("a", started=T0, steps=range(5, 7)), at=101.2)
    assert again.refusal is not None and again.refusal["status"] == 409
    after = stored(engine)
    assert len(after["conflicts"]) == 1 and after["losses"] == {n: 1.0 for n in range(7)}


def test_both_claimants_in_one_flush_the_holder_wins(engine: Engine) -> None:
    send(engine, claimant("a", started=T0, steps=range(2)), at=100)
    second = claimant("b", started=T0 + 50, steps=range(2), loss=9.0, pid=2000)
    holder = claimant("a", started=T0, steps=range(2, 3))
    results = send(engine, second, holder, at=101)
    assert results[0].refusal is not None and results[0].refusal["status"] == 409
    assert results[1].refusal is None and results[1].accepted_steps == 1
    assert stored(engine)["losses"] == {0: 1.0, 1: 1.0, 2: 1.0}


def test_a_holder_last_heard_before_the_newcomer_started_is_waited_for(engine: Engine) -> None:
    # The holder's last request (T0 + 100) came before the newcomer's process started
    # (T0 + 100.5): it may have just died. The newcomer is told to send again (503) ...
    send(engine, claimant("a", started=T0, steps=range(3)), at=100)
    newcomer = claimant("b", started=T0 + 100.5, steps=range(3, 5), pid=2000)
    (wait,) = send(engine, newcomer, at=101)
    assert wait.refusal is not None and wait.refusal["status"] == 503
    assert wait.refusal["retry_after"] == 1
    assert stored(engine)["session"] == "a" and stored(engine)["conflicts"] == []

    # ... and once the holder has been silent past 3 heartbeats (3 s), it was a restart.
    (taken,) = send(engine, newcomer, at=103.5)
    assert taken.refusal is None and taken.accepted_steps == 2
    after = stored(engine)
    assert after["session"] == "b" and after["pid"] == 2000 and after["conflicts"] == []
    assert [r["previous_session"] for r in after["restarts"]] == ["a"]
    assert after["losses"] == {n: 1.0 for n in range(5)}


def test_a_holder_heard_again_while_the_newcomer_waits_is_a_conflict(engine: Engine) -> None:
    send(engine, claimant("a", started=T0, steps=range(3)), at=100)
    newcomer = claimant("b", started=T0 + 100.5, steps=range(2), loss=9.0, pid=2000)
    (wait,) = send(engine, newcomer, at=100.6)
    send(engine, claimant("a", started=T0, steps=range(3, 4)), at=101)  # still alive
    (refused,) = send(engine, newcomer, at=101.6)
    assert wait.refusal is not None and wait.refusal["status"] == 503
    assert refused.refusal is not None and refused.refusal["status"] == 409
    after = stored(engine)
    assert len(after["conflicts"]) == 1 and after["losses"] == {n: 1.0 for n in range(4)}


@pytest.mark.parametrize("goodbye", ["shutdown", "attempt_end"])
def test_a_holder_that_said_goodbye_is_restarted_at_once(engine: Engine, goodbye: str) -> None:
    start = {"id": "a-start", "kind": "attempt_start", "ts": T0, "data": {}}
    bye = {"id": "a-bye", "kind": goodbye, "ts": T0 + 100, "data": {"reason": "completed"}}
    send(engine, claimant("a", started=T0, steps=range(3), events=[start]), at=99)
    send(engine, claimant("a", started=T0, events=[bye]), at=100)
    (taken,) = send(engine, claimant("b", started=T0 + 50, steps=range(3, 4), pid=2), at=100.5)
    assert taken.refusal is None and taken.accepted_steps == 1
    after = stored(engine)
    assert after["session"] == "b" and len(after["restarts"]) == 1 and after["conflicts"] == []


def test_an_earlier_process_s_goodbye_sent_from_the_spool_does_not_end_its_successor(
    engine: Engine,
) -> None:
    """Process a spooled its goodbye and was killed before it could send it; process b,
    the rank's next, sends what it found in the spool first, under its own name. The
    goodbye is stored, as an event, but it predates b: b's rank stays live and b's
    attempt open (the rank read ``failed`` while b trained, and a stop skipped it)."""
    send(engine, claimant("a", started=T0, steps=range(3)), at=10)
    said = {"reason": "exception", "detail": "RuntimeError: peer gone"}
    left = [
        {"id": "a-end", "kind": "attempt_end", "ts": T0 + 40, "data": said},
        {"id": "a-bye", "kind": "shutdown", "ts": T0 + 40, "data": {"error": "RuntimeError"}},
    ]
    start = {"id": "b-start", "kind": "attempt_start", "ts": T0 + 50, "data": {}}
    send(engine, claimant("b", started=T0 + 50, steps=range(3, 5), pid=2, events=left), at=60)
    send(engine, claimant("b", started=T0 + 50, steps=range(5, 6), pid=2, events=[start]), at=61)
    with engine.connect() as conn:
        k, s, e = m.ranks.c, m.attempt_sessions.c, m.events.c
        state, session = conn.execute(select(k.state, k.session).where(k.rank == 0)).one()
        ended = conn.execute(select(s.ended_at).where(s.session == "b")).scalar_one()
        kinds = set(conn.execute(select(e.kind)).scalars())
    assert (state, session, ended) == ("healthy", "b", None)
    assert {"attempt_end", "shutdown"} <= kinds  # kept, as the earlier process's record


def test_a_nodes_request_loses_only_the_conflicting_ranks_rows(engine: Engine) -> None:
    # Rank 1 is held by a live process of another job; this node's request (ranks 0 and 1
    # of a second job) keeps its rank 0 and loses its rank 1, and says so per rank.
    send(engine, claimant("other", started=T0, rank=1, steps=range(4), loss=1.0), at=100)
    agents = [
        {"rank": r, "host": "node-b", "pid": 2000 + r, "session": f"b{r}", "started_at": T0 + 90}
        for r in (0, 1)
    ]
    cols: dict[str, list[Any]] = {"rank": [], "step": [], "ts": [], "duration_s": [], "loss": []}
    for n in range(2):
        for r in (0, 1):
            cols["rank"].append(r)
            cols["step"].append(n)
            cols["ts"].append(T0 + n)
            cols["duration_s"].append(0.1)
            cols["loss"].append(9.0)
    extras = [
        {
            "run": "r1",
            "agent": {**a, "world_size": 2},
            "events": [{"id": f"ev{a['rank']}", "kind": "start", "ts": T0 + 90}],
        }
        for a in agents
    ]
    node = ColumnarBatch.model_validate(
        {"run": "r1", "world_size": 2, "agents": agents, "steps": cols, "extras": extras}
    )
    (result,) = send(engine, node, at=100.5)
    assert result.accepted_steps == 2 and result.accepted_events == 1
    assert result.rank_refused is not None and set(result.rank_refused) == {1}
    assert result.rank_refused[1]["status"] == 409
    assert result.rank_refused[1]["holder"]["session"] == "other"
    assert stored(engine, rank=1)["losses"] == {n: 1.0 for n in range(4)}
    assert stored(engine, rank=1)["session"] == "other"
    assert stored(engine, rank=0)["losses"] == {0: 9.0, 1: 9.0}


@pytest.fixture
def client(engine: Engine):  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def test_the_api_answers_a_second_live_process_409_with_the_holder(client: TestClient) -> None:
    now = time.time()
    first = batch(rank=0, session="a", steps=[step(0)])
    first["agent"].update(started_at=now - 60, heartbeat_s=2.0)
    assert client.post("/api/v1/ingest", json=first).status_code == 200
    second = batch(rank=0, session="b", steps=[step(0, loss=9.0)])
    second["agent"].update(started_at=now - 30, heartbeat_s=2.0, pid=4321, host="other")
    answer = client.post("/api/v1/ingest", json=second)
    assert answer.status_code == 409, answer.text
    body = answer.json()
    assert (body["run"], body["rank"], body["reason"]) == ("r1", 0, "rank_conflict")
    assert body["holder"] == {"pid": 1000, "host": "host0", "node": "node0", "session": "a"}
    assert "rank 0 is held by another live process" in body["detail"]
    events = client.get("/api/v1/runs/r1/events", params={"kind": "rank_conflict"}).json()
    assert [(e["data"]["first"]["pid"], e["data"]["second"]["pid"]) for e in events] == [
        (1000, 4321)
    ]
