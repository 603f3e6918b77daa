"""A hung run's collectives: the ranks are asked for their Flight Recorder rings, the
verdict names the culprit in the rank states, the alert (RankHung, or RankDead for a dead
culprit), the timeline, the post-mortem and the API; bad rings are refused (malformed) or
left out and said (on SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, insert, select

from trainwarden.alerts import load_rule_packs
from trainwarden.collector.actions.commands import CommandBoard
from trainwarden.collector.alerting.engine import AlertEngine
from trainwarden.collector.app import create_app
from trainwarden.collector.health import hang
from trainwarden.collector.health.evaluator import evaluate
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.incidents.grouping import group
from trainwarden.collector.incidents.postmortem import report_of
from trainwarden.collector.incidents.report_format import render_markdown
from trainwarden.collector.incidents.timeline import timeline
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step

T0 = time.time() - 3600  # events may not be from the future: an hour ago
WORLD = 4


def beat(engine, rank: int, at: float, *, steps=(), last_step=None, events=()) -> None:
    body = batch(rank=rank, world_size=WORLD, steps=list(steps), events=list(events))
    body["agent"].update(
        heartbeat_s=2.0,
        last_step=last_step,
        in_step=last_step is not None and not steps,
        sent_at=at,
        last_step_end=at if steps else None,
    )
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=at)


def entry(seq: int, done: bool) -> dict[str, Any]:
    return {
        "seq": seq,
        "op": "all_reduce",
        "in_sizes": [[1024]],
        "in_dtypes": ["Float"],
        "out_sizes": [[1024]],
        "out_dtypes": ["Float"],
        "state": "scheduled",
        "done": done,
        "created": T0 + seq,
    }


def ring(rank: int, last: int, *, waiting: bool, at: float, request=None) -> dict[str, Any]:
    entries = [entry(s, True) for s in range(max(1, last - 5), last)]
    entries.append(entry(last, not waiting))
    return {
        "id": f"coll-{rank}-{at}",
        "kind": "collectives",
        "ts": at,
        "step": 9,
        "data": {
            "trigger": "command",
            "request": request,
            "available": True,
            "reason": None,
            "dumped_at": at,
            "groups": [
                {"pg": "0", "desc": "default_pg", "ranks": list(range(WORLD)), "entries": entries}
            ],
        },
    }


def sent_ring(engine, rank: int, last: int, *, waiting: bool, at: float) -> None:
    """Rank ``rank``'s ring dumped at ``at``, sent with a beat 0.1 s later (step 9 done)."""
    beat(engine, rank, at + 0.1, last_step=9, events=[ring(rank, last, waiting=waiting, at=at)])


def evaluated(engine, now: float, board: CommandBoard | None = None) -> dict[int, tuple]:
    flush(engine, now=now, grace_s=0)
    with write(engine) as conn:
        evaluate(conn, now=now, settings=HealthSettings(), board=board)
        rows = conn.execute(select(m.ranks.c.rank, m.ranks.c.state, m.ranks.c.state_detail))
        return {r: (s, d or {}) for r, s, d in rows}


def hang_at_step_10(engine) -> None:
    """Four ranks finish step 9 at T0 + 10; rank 2 then stops; all beat on."""
    for rank in range(WORLD):
        beat(engine, rank, T0 + 10, steps=[step(i) for i in range(10)])
    for rank in range(WORLD):
        beat(engine, rank, T0 + 15.5, last_step=9)


def test_a_hung_run_is_asked_for_rings_and_the_verdict_names_the_culprit(engine) -> None:
    hang_at_step_10(engine)
    board = CommandBoard()
    states = evaluated(engine, T0 + 15.6, board)
    assert {s for s, _ in states.values()} == {"hung"}
    assert board.runs == {"r1"}
    with write(engine) as conn:  # every rank gets the request on its next ingest answer
        asked = {r: board.take(conn, "r1", r, T0 + 16) for r in range(WORLD)}
    assert all(len(c) == 1 and c[0]["type"] == "collectives" for c in asked.values())
    # The rings: rank 2 never issued #40; the others wait in it.
    for rank in range(WORLD):
        request = asked[rank][0]["id"]
        beat(
            engine,
            rank,
            T0 + 16.5,
            last_step=9,
            events=[
                ring(
                    rank, 39 if rank == 2 else 40, waiting=rank != 2, at=T0 + 16.4, request=request
                )
            ],
        )
    states = evaluated(engine, T0 + 17)
    summary = states[2][1]["collective"]
    assert summary.startswith(
        "rank 2 (node node2) never entered all_reduce #40 on pg 0 (default_pg, 4 ranks); "
        "3 ranks wait in it since "
    )
    assert states[2][1]["role"] == "culprit"
    for rank in (0, 1, 3):
        assert states[rank][1]["role"] == "victim" and states[rank][1]["waiting_on"] == [2]
        assert states[rank][1]["collective"] == summary
    evaluated(engine, T0 + 18)  # the same verdict is stored once
    with engine.connect() as conn:
        verdicts = conn.execute(
            select(m.events.c.rank, m.events.c.data).where(m.events.c.kind == "hang_verdict")
        ).all()
        view = hang.view(conn, run="r1", now=T0 + 18)
        entries = timeline(conn, run="r1", now=T0 + 18)["entries"]
    assert [(r, d["culprits"], d["seq"], d["op"]) for r, d in verdicts] == [
        (2, [2], 40, "all_reduce")
    ]
    assert view["verdict"]["summary"] == summary
    # The timeline (and so the post-mortem) says it; the raw rings are not entries.
    said = [(e["kind"], e["rank"], e["text"]) for e in entries if e["source"] == "event"]
    assert ("hang_verdict", 2, f"hung collective: {summary}") in said
    assert not [e for e in said if e[0] == "collectives"]
    rows = view["groups"][0]["rows"]
    assert [(r["rank"], r["role"], r["last_seq"]) for r in rows] == [
        (2, "culprit", 39),
        (0, "victim", 40),
        (1, "victim", 40),
        (3, "victim", 40),
    ]
    assert view["requested_at"] == pytest.approx(T0 + 15.6)
    # Requests stop going out after their time; a new hang asks again.
    with write(engine) as conn:
        assert hang.close_requests(conn, T0 + 15.6 + hang.REQUEST_TTL_S + 1) == WORLD
        board.refresh(conn)
    assert board.runs == set()


def view_and_rings(engine, now: float) -> tuple[dict[str, Any], list[int]]:
    """The API's view, and the ranks of every ``collectives`` event stored (sorted)."""
    with engine.connect() as conn:
        view = hang.view(conn, run="r1", now=now)
        stored = conn.execute(
            select(m.events.c.rank).where(m.events.c.kind == "collectives")
        ).scalars()
        return view, sorted(stored)


def test_a_ring_naming_ranks_outside_the_world_is_stored_but_left_out(engine) -> None:
    hang_at_step_10(engine)
    evaluated(engine, T0 + 15.6)
    bad = ring(1, 40, waiting=True, at=T0 + 16.4)
    bad["data"]["groups"][0]["ranks"] = [0, 1, 2, 3, 7]
    for rank in range(WORLD):
        events = (
            [bad]
            if rank == 1
            else [ring(rank, 39 if rank == 2 else 40, waiting=rank != 2, at=T0 + 16.4)]
        )
        beat(engine, rank, T0 + 16.5, last_step=9, events=events)
    evaluated(engine, T0 + 17)
    view, stored = view_and_rings(engine, T0 + 17)
    assert stored == [0, 1, 2, 3]
    assert view["verdict"]["unusable"] == {
        "1": "its pg 0 names rank 7, outside the run's world (4 ranks)"
    }
    assert view["verdict"]["culprits"] == [2] and view["verdict"]["victims"] == [0, 3]


def test_a_culprit_named_stands_when_its_next_ring_cannot_be_read(engine) -> None:
    # Rank 2 is named from the rings; its next ring goes back (#35 after #39): left out,
    # the others' rings alone would say "no rank is missing". The culprit stands, in the
    # ranks' details (what a teardown's JobLostInCollective page says) and the store.
    hang_at_step_10(engine)
    evaluated(engine, T0 + 15.6)
    for rank in range(WORLD):
        last = 39 if rank == 2 else 40
        events = [ring(rank, last, waiting=rank != 2, at=T0 + 16.1)]
        beat(engine, rank, T0 + 16.2, last_step=9, events=events)
    named = evaluated(engine, T0 + 17)[2][1]["collective"]
    assert named.startswith("rank 2 (node node2) never entered all_reduce #40")
    beat(engine, 2, T0 + 17.5, last_step=9, events=[ring(2, 35, waiting=False, at=T0 + 17.4)])
    states = evaluated(engine, T0 + 18)
    with engine.connect() as conn:
        view = hang.view(conn, run="r1", now=T0 + 18)
        stored = (
            conn.execute(select(m.events.c.data).where(m.events.c.kind == "hang_verdict"))
            .scalars()
            .all()
        )
    assert view["verdict"]["kind"] == "incomplete", view["verdict"]  # the rings as they are
    assert view["verdict"]["unread"] == [2]
    assert [d["summary"] for d in stored] == [named]
    assert states[2][1]["role"] == "culprit" and states[2][1]["collective"] == named
    for rank in (0, 1, 3):
        assert states[rank][1]["role"] == "victim" and states[rank][1]["collective"] == named
    # Read again (its next ring goes on from #39): still named, nothing stored twice.
    beat(engine, 2, T0 + 18.5, last_step=9, events=[ring(2, 39, waiting=False, at=T0 + 18.4)])
    states = evaluated(engine, T0 + 19)
    assert states[2][1]["collective"] == named
    with engine.connect() as conn:
        count = conn.execute(
            select(func.count()).where(m.events.c.kind == "hang_verdict")
        ).scalar_one()
    assert count == 1


def test_a_ring_that_commits_after_a_higher_id_is_still_read(engine) -> None:
    # On PostgreSQL an id is taken at insert and seen at commit: rank 2's ring may take a
    # lower id than the others' and commit after the pass that read them.
    hang_at_step_10(engine)
    evaluated(engine, T0 + 15.6)
    with write(engine) as conn:
        run_id = conn.execute(select(m.runs.c.id).where(m.runs.c.name == "r1")).scalar_one()
        held = conn.execute(
            insert(m.events)
            .values(
                uid="held", run_id=run_id, ts=T0 + 16, recv_ts=T0 + 16, kind="x", severity="info"
            )
            .returning(m.events.c.id)
        ).scalar_one()
    for rank in (0, 1, 3):
        sent_ring(engine, rank, 40, waiting=True, at=T0 + 16.1)
    assert evaluated(engine, T0 + 17)[0][1]["collective"].startswith(
        "ranks 0, 1, 3 (nodes node0, node1, node3) wait in"
    )
    late = ring(2, 39, waiting=False, at=T0 + 16.1)
    with write(engine) as conn:
        conn.execute(m.events.delete().where(m.events.c.id == held))
        conn.execute(
            insert(m.events).values(
                id=held,
                uid=late["id"],
                run_id=run_id,
                rank=2,
                step=9,
                ts=T0 + 16.1,
                recv_ts=T0 + 17.5,
                kind="collectives",
                severity="warning",
                data=late["data"],
            )
        )
    states = evaluated(engine, T0 + 18)
    assert states[2][1]["role"] == "culprit", states[2][1]
    assert states[0][1]["collective"].startswith("rank 2 (node node2) never entered")


def test_a_new_hang_is_not_judged_on_the_rings_of_one_the_ranks_got_past(engine) -> None:
    # Rank 2 hung at step 10 and was named; the hang ended and every rank trained on to
    # step 19. When the ranks stall again, the rings of the first hang (within the minute
    # the rings are read back) tell of it, not of this one: no verdict until new ones come.
    hang_at_step_10(engine)
    evaluated(engine, T0 + 15.6)
    for rank in range(WORLD):
        sent_ring(engine, rank, 39 if rank == 2 else 40, waiting=rank != 2, at=T0 + 16.1)
    assert evaluated(engine, T0 + 17)[2][1]["role"] == "culprit"
    for rank in range(WORLD):  # past it: steps 10 to 19
        beat(engine, rank, T0 + 20, steps=[step(i) for i in range(10, 20)])
    assert {s for s, _ in evaluated(engine, T0 + 20.5).values()} == {"healthy"}
    for rank in range(WORLD):  # stalled again after step 19
        beat(engine, rank, T0 + 26, last_step=19)
    states = evaluated(engine, T0 + 26.1)
    assert {s for s, _ in states.values()} == {"hung"}
    for rank, (_, detail) in states.items():
        said = str(detail.get("collective"))
        assert said.startswith("no usable Flight Recorder ring yet"), (rank, detail)
    # Its own rings name its own culprit: rank 0 this time.
    for rank in range(WORLD):
        sent_ring(engine, rank, 49 if rank == 0 else 50, waiting=rank != 0, at=T0 + 26.5)
    states = evaluated(engine, T0 + 27)
    assert states[0][1]["role"] == "culprit", states[0][1]
    assert "all_reduce #50" in states[1][1]["collective"]


def test_a_ring_going_back_from_the_ranks_earlier_one_is_stored_but_left_out(engine) -> None:
    hang_at_step_10(engine)
    evaluated(engine, T0 + 15.6)
    for rank in range(WORLD):
        last = 39 if rank == 2 else 40
        beat(
            engine,
            rank,
            T0 + 16.2,
            last_step=9,
            events=[ring(rank, last, waiting=True, at=T0 + 16.1)],
        )
    # Rank 1's next ring ends at #35, its earlier one at #40: its sequence ids went back.
    beat(engine, 1, T0 + 16.5, last_step=9, events=[ring(1, 35, waiting=True, at=T0 + 16.4)])
    states = evaluated(engine, T0 + 17)
    view, stored = view_and_rings(engine, T0 + 17)
    with engine.connect() as conn:
        (verdict,) = (
            conn.execute(select(m.events.c.data).where(m.events.c.kind == "hang_verdict"))
            .scalars()
            .all()
        )
    assert stored == [0, 1, 1, 2, 3]
    why = (
        "its sequence ids go backwards on pg 0: its newest ring ends at #35, the one it "
        "sent before at #40"
    )
    for said in (verdict, view["verdict"]):  # the stored verdict and the API's
        assert said["unusable"] == {"1": why}
        assert said["culprits"] == [2] and said["victims"] == [0, 3]
    assert states[1][1]["role"] == "victim"  # the hung rank's own state, not its ring's
    rows = {r["rank"]: r for r in view["groups"][0]["rows"]}
    assert rows[1]["note"] == f"left out: {why}" and rows[1]["role"] is None
    assert rows[0]["note"] is None
    # A restart (a new attempt) between the two rings numbers its collectives from 1
    # again: not backwards.
    with write(engine) as conn:
        run_id = conn.execute(select(m.runs.c.id).where(m.runs.c.name == "r1")).scalar_one()
        conn.execute(
            insert(m.attempts).values(run_id=run_id, number=2, started_at=T0 + 16.3, nodes=[])
        )
    with engine.connect() as conn:
        view = hang.view(conn, run="r1", now=T0 + 17)
    assert view["verdict"]["unusable"] == {}


@pytest.fixture
def client(engine):  # type: ignore[no-untyped-def]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as c:
        yield c


def test_a_malformed_collectives_event_is_refused_naming_the_field(client) -> None:
    body = batch(rank=0, world_size=WORLD, events=[ring(0, 40, waiting=True, at=T0 + 1)])
    body["events"].append({"id": "ok", "kind": "start", "ts": T0})
    body["events"][0]["data"]["groups"][0]["entries"][2]["seq"] = "forty"
    response = client.post("/api/v1/ingest", json=body)
    assert response.status_code == 422, response.text
    assert "data.groups.0.entries.2.seq" in response.text
    with client.app.state.engine.connect() as conn:
        assert conn.execute(select(m.events.c.id)).all() == []
        assert conn.execute(select(m.ranks.c.rank)).all() == []


def test_an_operator_asks_every_rank_and_reads_the_verdict(client) -> None:
    for rank in range(WORLD):
        response = client.post("/api/v1/ingest", json=batch(rank=rank, world_size=WORLD))
        assert response.status_code == 200
    asked = client.post("/api/v1/runs/r1/collectives")
    assert asked.status_code == 202 and asked.json()["ranks"] == WORLD
    answer = client.post("/api/v1/ingest", json=batch(rank=1, world_size=WORLD)).json()
    assert [c["type"] for c in answer["commands"]] == ["collectives"]
    for rank in range(WORLD):
        events = [ring(rank, 39 if rank == 3 else 40, waiting=rank != 3, at=T0 + 2)]
        client.post("/api/v1/ingest", json=batch(rank=rank, world_size=WORLD, events=events))
    view = client.get("/api/v1/runs/r1/collectives").json()
    assert view["verdict"]["kind"] == "culprit" and view["verdict"]["culprits"] == [3]
    assert set(view["rings"]) == {"0", "1", "2", "3"}
    assert client.get("/api/v1/runs/nope/collectives").status_code == 404
    assert client.post("/api/v1/runs/nope/collectives").status_code == 404


def test_a_dead_rank_is_named_the_culprit_from_the_survivors_rings(engine) -> None:
    for rank in range(WORLD):
        beat(engine, rank, T0 + 10, steps=[step(i) for i in range(10)])
    for rank in (0, 1, 3):  # rank 2's process died: no heartbeat since T0 + 10
        beat(engine, rank, T0 + 15.5, last_step=9)
    states = evaluated(engine, T0 + 15.6)
    assert states[2][0] == "dead" and {states[r][0] for r in (0, 1, 3)} == {"hung"}
    for rank in (0, 1, 3):
        sent_ring(engine, rank, 40, waiting=True, at=T0 + 16.4)
    states = evaluated(engine, T0 + 17)
    summary = states[0][1]["collective"]
    assert summary.startswith(
        "rank 2 (node node2) is dead (no heartbeats) and never entered all_reduce #40 on pg 0 "
        "(default_pg, 4 ranks); 3 ranks wait in it since "
    )
    assert all(states[r][1]["waiting_on"] == [2] for r in (0, 1, 3))
    # The dead rank is no longer read (silent since it was found dead), yet its details
    # name the verdict, and the RankDead alert carries it to the page (no RankHung fires:
    # the hung ranks are victims).
    assert states[2] == ("dead", {**states[2][1], "role": "culprit", "collective": summary})
    alerts = AlertEngine(
        engine,
        [r for r in load_rule_packs() if r.name in ("RankDead", "RankHung")],
        external_url="https://tw.example.org",
        submit=lambda _: None,
    )
    alerts.run_once(now=T0 + 17.5)
    with engine.connect() as conn:
        rows = conn.execute(select(m.alerts.c.rule, m.alerts.c.rank, m.alerts.c.annotations)).all()
    ((rule, rank, annotations),) = rows
    assert (rule, rank, annotations["collective"]) == ("RankDead", 2, summary)
    assert annotations["description"].endswith(f": {summary}")
    # The page opens an incident; its post-mortem tells the verdict.
    with write(engine) as conn:
        assert len(group(conn, now=T0 + 18, cooldown_s=60).opened) == 1
    with engine.connect() as conn:
        report = report_of(conn, run="r1", now=T0 + 18, charts=False)
    (incident,) = report["incidents"]
    said = [(e["kind"], e["rank"], e["text"]) for e in incident["entries"]]
    assert ("hang_verdict", 2, f"hung collective: {summary}") in said
    assert f"hung collective: {summary}" in render_markdown(report)
