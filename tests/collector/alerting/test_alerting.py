"""The alert engine on a real database (SQLite and PostgreSQL), with a controlled clock:
lifecycle rows, notifications, resends, acknowledgements, silences, inhibition and
what survives a restart."""

from __future__ import annotations

import shutil
import subprocess
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event as sa_event
from sqlalchemy import insert, select, update

from trainwarden.alerts import load_rule_packs, parse_rule
from trainwarden.collector.alerting.engine import AlertEngine, EngineSettings
from trainwarden.collector.alerting.notify import Attempt
from trainwarden.collector.alerting.snapshot import recent_steps
from trainwarden.collector.app import create_app
from trainwarden.collector.health.evaluator import evaluate
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.limits import Pressure
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step

T0 = 1_700_000_000.0
RULES = {r.name: r for r in load_rule_packs()}
EXTERNAL = "https://tw.example.org"


def send(engine, *, rank: int, at: float, world: int = 2, steps=(), events=(), node=None) -> None:  # type: ignore[no-untyped-def]
    body = batch(rank=rank, world_size=world, steps=list(steps), events=list(events))
    done = [s["step"] for s in steps]
    body["agent"].update(
        heartbeat_s=2.0,
        sent_at=at,
        last_step=max(done) if done else None,
        last_step_end=at if done else None,
        node=node or f"node{rank // 2}",
    )
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=at)


def xid(code: int, at: float, uid: str) -> dict[str, Any]:
    return {"id": uid, "kind": "xid", "ts": at, "severity": "critical", "data": {"code": code}}


class Engine:
    """An AlertEngine over a chosen set of rules, recording what it would send."""

    def __init__(self, engine, *names: str, **settings: Any) -> None:  # type: ignore[no-untyped-def]
        self.sent: list[Any] = []
        self.engine = engine
        self.names = names
        self.settings = EngineSettings(**settings)
        self.pressure: Pressure | None = None
        self.alerts = self._new()

    def _new(self) -> AlertEngine:
        return AlertEngine(
            self.engine,
            [RULES[n] for n in self.names],
            settings=self.settings,
            external_url=EXTERNAL,
            submit=self.sent.append,
            pressure=self.pressure,
        )

    def restart(self) -> None:
        self.alerts = self._new()

    def run(self, now: float) -> list[dict[str, Any]]:
        flush(self.engine, now=now, grace_s=0)
        self.alerts.run_once(now=now)
        with self.engine.connect() as conn:
            return [
                dict(r._mapping) for r in conn.execute(select(m.alerts).order_by(m.alerts.c.id))
            ]


def test_fatal_xid_fires_at_once_pages_once_and_resolves_after_keep_firing_for(engine) -> None:
    alerts = Engine(engine, "FatalXid")
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(1)])
    assert alerts.run(T0 + 1) == []
    send(engine, rank=1, at=T0 + 2, events=[xid(79, T0 + 2, "x1"), xid(13, T0 + 2, "x2")])
    (row,) = alerts.run(T0 + 2.5)
    assert (row["rule"], row["state"], row["rank"], row["node"]) == (
        "FatalXid",
        "firing",
        1,
        "node0",
    )
    assert "XID 79" in row["annotations"]["description"]
    assert row["annotations"]["runbook_url"] == f"{EXTERNAL}/runbooks/FatalXid"
    (note,) = alerts.sent
    assert (note.status, note.alert_id) == ("firing", row["id"])
    assert (
        note.labels
        | {
            "run": "r1",
            "rank": "1",
            "node": "node0",
            "alertname": "FatalXid",
            "severity": "critical",
            "category": "hardware",
        }
        == note.labels
    )
    assert note.generator_url == f"{EXTERNAL}/runs/r1"
    # Later passes: the instant is over, the alert is kept firing for an hour, not re-sent.
    for t in (T0 + 20, T0 + 600, T0 + 1800):
        (row,) = alerts.run(t)
        assert row["state"] == "firing" and row["cleared_at"] is not None
    assert len(alerts.sent) == 1
    (row,) = alerts.run(T0 + 3700)
    assert row["state"] == "resolved" and row["resolved_at"] == T0 + 3700
    assert [n.status for n in alerts.sent] == ["firing", "resolved"]
    assert alerts.sent[1].ends_at == T0 + 3700


def test_an_alert_whose_own_action_is_done_resolves_without_keep_firing_for(engine) -> None:
    # FatalXid keeps firing for an hour after its instant (the test above). Once its own
    # eviction is done (not a dry run) in this episode, it resolves when it clears: the
    # action dealt with it, and on-call is told so.
    alerts = Engine(engine, "FatalXid")
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(1)])
    send(engine, rank=1, at=T0 + 2, events=[xid(79, T0 + 2, "x1")])
    (row,) = alerts.run(T0 + 2.5)
    assert row["state"] == "firing"

    def action(mode: str, state: str, at: float) -> None:
        with write(engine) as conn:
            conn.execute(
                insert(m.actions).values(
                    run_id=row["run_id"],
                    kind="evict",
                    state=state,
                    mode=mode,
                    trigger="rule:FatalXid",
                    alert_id=row["id"],
                    node="node0",
                    history=[],
                    created_at=at,
                    updated_at=at,
                    finished_at=at,
                )
            )

    action("dry-run", "done", T0 + 3)  # a dry run did nothing: the hold stays
    action("auto", "failed", T0 + 4)  # nor did a failed one
    action("auto", "done", T0 - 100)  # an earlier episode's
    (row,) = alerts.run(T0 + 20)
    assert row["state"] == "firing" and row["cleared_at"] == T0 + 20
    action("auto", "done", T0 + 21)
    (row,) = alerts.run(T0 + 22)
    assert (row["state"], row["resolved_at"]) == ("resolved", T0 + 22)
    assert [n.status for n in alerts.sent] == ["firing", "resolved"]


def test_a_stability_alert_resolves_when_a_rollback_replaced_the_steps_it_fired_on(engine) -> None:
    # GradNormSpikeBurst has no action of its own; a rollback (LossSpike's) that threw
    # away its flagged steps deals with it too: it resolves as its condition clears.
    alerts = Engine(engine, "GradNormSpikeBurst")

    def steps(spiky: bool, t0: float) -> list[dict[str, Any]]:
        return [
            {
                **step(n),
                "ts": t0 + n,
                **({"flags": ["grad_norm_spike"]} if spiky and n >= 3 else {}),
            }
            for n in range(10)
        ]

    for rank in (0, 1):
        send(engine, rank=rank, at=T0 + 10, steps=steps(True, T0))
    (row,) = alerts.run(T0 + 11)
    assert row["state"] == "firing"
    for rank in (0, 1):  # rolled back to step 2: 3-9 run again, without a spike
        send(engine, rank=rank, at=T0 + 30, steps=steps(False, T0 + 20)[3:])
    (row,) = alerts.run(T0 + 31)
    assert (row["state"], row["cleared_at"]) == ("firing", T0 + 31)  # held: keep_firing_for 10m
    with write(engine) as conn:
        for mode, state in (("dry-run", "done"), ("auto", "done")):
            conn.execute(
                insert(m.actions).values(
                    run_id=row["run_id"],
                    kind="rollback",
                    state=state,
                    mode=mode,
                    trigger="rule:LossSpike",
                    history=[],
                    created_at=T0 + 25,
                    updated_at=T0 + 30,
                )
            )
    (row,) = alerts.run(T0 + 32)
    assert (row["state"], row["resolved_at"]) == ("resolved", T0 + 32)


def test_an_alert_names_its_ranks_gpu_or_else_its_local_rank(engine) -> None:
    alerts = Engine(engine, "FatalXid")
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(1)])
    with write(engine) as conn:  # as the agent's GPU inventory leaves it
        conn.execute(update(m.ranks).where(m.ranks.c.rank == 1).values(gpu={"uuid": "GPU-5d1e"}))
    for rank in (0, 1):
        send(engine, rank=rank, at=T0 + 2, events=[xid(79, T0 + 2, f"x{rank}")])
    found = {row["rank"]: (row["node"], row["gpu"]) for row in alerts.run(T0 + 2.5)}
    local_rank_0 = batch(rank=0, world_size=2)["agent"].get("local_rank", 0)
    assert found == {0: ("node0", str(local_rank_0)), 1: ("node0", "GPU-5d1e")}


def test_an_xid_whose_catalog_action_is_not_fatal_raises_nothing(engine) -> None:
    alerts = Engine(engine, "FatalXid")
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(13, T0, "a"), xid(31, T0, "b")])
    assert alerts.run(T0 + 1) == []


def straggling(engine, first: int, last: int, *, at: float, slow_rank: int = 1) -> None:  # type: ignore[no-untyped-def]
    for rank in (0, 1, 2):
        compute = 0.3 if rank == slow_rank else 0.1
        steps = [{**step(n, duration=compute), "compute_s": compute} for n in range(first, last)]
        send(engine, rank=rank, world=3, at=at, steps=steps)


def test_straggler_is_pending_for_20_steps_then_fires_then_resolves(engine) -> None:
    alerts = Engine(engine, "Straggler")
    straggling(engine, 0, 5, at=T0)
    (row,) = alerts.run(T0 + 1)
    assert (row["state"], row["rank"]) == ("pending", 1)
    assert row["value"] == pytest.approx(3.0) and "3.00x" in row["annotations"]["description"]
    straggling(engine, 5, 20, at=T0 + 2)
    assert alerts.run(T0 + 3)[0]["state"] == "pending"  # 15 steps so far: not yet
    assert alerts.sent == []
    straggling(engine, 20, 30, at=T0 + 4)
    (row,) = alerts.run(T0 + 5)
    assert row["state"] == "firing" and row["fired_at"] == T0 + 5
    assert (row["active_since_step"], row["fired_at_step"], row["step"]) == (4, 29, 29)
    assert [n.status for n in alerts.sent] == ["firing"]
    straggling(engine, 30, 35, at=T0 + 5.5)  # still slow: the alert's step moves on, not its firing
    (row,) = alerts.run(T0 + 5.8)
    assert (row["state"], row["fired_at_step"], row["step"]) == ("firing", 29, 34)
    straggling(engine, 35, 40, at=T0 + 6, slow_rank=-1)  # everyone even again
    (row,) = alerts.run(T0 + 7)
    assert row["state"] == "resolved"
    assert [n.status for n in alerts.sent] == ["firing", "resolved"]


def test_a_pending_alert_that_clears_is_forgotten(engine) -> None:
    alerts = Engine(engine, "Straggler")
    straggling(engine, 0, 5, at=T0)
    assert [r["state"] for r in alerts.run(T0 + 1)] == ["pending"]
    straggling(engine, 5, 10, at=T0 + 2, slow_rank=-1)
    assert alerts.run(T0 + 3) == []
    assert alerts.sent == []


def test_resend_until_acknowledged(engine) -> None:
    alerts = Engine(engine, "FatalXid", resend_s=60.0)
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(79, T0, "x")])
    alerts.run(T0 + 1)
    alerts.run(T0 + 30)
    assert len(alerts.sent) == 1
    (row,) = alerts.run(T0 + 62)
    assert len(alerts.sent) == 2 and row["last_sent_at"] == T0 + 62
    with write(engine) as conn:
        conn.execute(update(m.alerts).values(acked_at=T0 + 70, acked_by="oncall"))
    alerts.run(T0 + 200)
    assert len(alerts.sent) == 2  # acknowledged: no more resends ...
    alerts.run(T0 + 3700)
    assert [n.status for n in alerts.sent] == [
        "firing",
        "firing",
        "resolved",
    ]  # ... but it resolves


def test_a_silence_keeps_the_alert_but_pages_nobody(engine) -> None:
    with write(engine) as conn:
        conn.execute(
            insert(m.silences).values(
                matchers=[
                    {"name": "alertname", "value": "Fatal.*", "regex": True},
                    {"name": "rank", "value": "0", "regex": False},
                ],
                starts_at=T0,
                ends_at=T0 + 100,
                created_by="me",
                comment="reseating the GPU",
                created_at=T0,
            )
        )
    alerts = Engine(engine, "FatalXid")
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(79, T0, "a")])
    send(engine, rank=1, at=T0, steps=[step(1)], events=[xid(79, T0, "b")])
    rows = alerts.run(T0 + 1)
    assert {r["rank"]: r["silenced_by"] for r in rows} == {0: 1, 1: None}
    assert [n.labels["rank"] for n in alerts.sent] == ["1"]
    (rank0,) = [r for r in alerts.run(T0 + 101) if r["rank"] == 0]  # the silence ended
    assert rank0["silenced_by"] is None
    assert sorted(n.labels["rank"] for n in alerts.sent) == ["0", "1"]


def test_a_dead_rank_is_not_also_paged_as_a_straggler(engine) -> None:
    alerts = Engine(engine, "Straggler", "RankDead")
    straggling(engine, 0, 30, at=T0)
    alerts.run(T0 + 0.5)
    straggling(engine, 30, 60, at=T0 + 1)
    (straggler,) = alerts.run(T0 + 1.5)
    assert straggler["state"] == "firing" and straggler["inhibited_by"] is None
    for rank in (0, 2):  # rank 1 goes quiet; its peers keep beating
        send(engine, rank=rank, world=3, at=T0 + 10)
    rows = {r["rule"]: r for r in alerts.run(T0 + 10)}
    assert rows["RankDead"]["state"] == "firing" and rows["RankDead"]["rank"] == 1
    assert rows["Straggler"]["inhibited_by"] == rows["RankDead"]["id"]
    assert [(n.alertname, n.status) for n in alerts.sent] == [
        ("Straggler", "firing"),
        ("RankDead", "firing"),
    ]


def test_an_evicting_alert_inhibits_the_rest_of_its_node(engine) -> None:
    alerts = Engine(engine, "FatalXid", "Straggler")
    straggling(engine, 0, 30, at=T0, slow_rank=0)  # ranks 0 and 1 on node0, 2 on node1
    alerts.run(T0 + 0.5)
    straggling(engine, 30, 60, at=T0 + 1, slow_rank=0)
    send(engine, rank=1, world=3, at=T0 + 1, events=[xid(79, T0 + 1, "x")])
    rows = {r["rule"]: r for r in alerts.run(T0 + 1.5)}
    assert rows["FatalXid"]["node"] == rows["Straggler"]["node"] == "node0"
    assert rows["Straggler"]["inhibited_by"] == rows["FatalXid"]["id"]
    assert [n.alertname for n in alerts.sent] == ["FatalXid"]


def test_state_survives_a_restart_of_the_engine(engine) -> None:
    alerts = Engine(engine, "FatalXid")
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(79, T0, "x")])
    (before,) = alerts.run(T0 + 1)
    alerts.restart()
    (after,) = alerts.run(T0 + 5)
    assert after["id"] == before["id"] and after["fired_at"] == before["fired_at"]
    assert len(alerts.sent) == 1  # not paged again by the new process


def test_delivery_attempts_are_stored_and_served(engine) -> None:
    alerts = Engine(engine, "FatalXid")
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(79, T0, "x")])
    (row,) = alerts.run(T0 + 1)
    for n, ok in ((1, False), (2, True)):
        alerts.alerts.deliveries.append(
            Attempt(
                alert_id=row["id"],
                fingerprint=row["fingerprint"],
                status="firing",
                receiver="pd",
                kind="pagerduty",
                attempt=n,
                ok=ok,
                http_status=202 if ok else 500,
                error=None if ok else "HTTP 500: down",
                at=T0 + n,
                duration_s=0.01,
                final=ok,
            )
        )
    alerts.run(T0 + 2)
    app = create_app(engine, ui=False, health=None, rollups=False, alerting=None)
    with TestClient(app) as client:
        detail = client.get(f"/api/v1/alerts/{row['id']}").json()
        assert [(d["attempt"], d["ok"], d["http_status"]) for d in detail["deliveries"]] == [
            (1, False, 500),
            (2, True, 202),
        ]
        assert detail["runbook_url"] == f"{EXTERNAL}/runbooks/FatalXid"
        listed = client.get("/api/v1/alerts", params={"run": "r1", "state": "firing"}).json()
        assert [a["id"] for a in listed] == [row["id"]] and listed[0]["labels"][
            "alertname"
        ] == "FatalXid"
        metrics = client.get("/metrics").text
        assert 'trainwarden_alerts{run="r1",severity="critical",state="firing"} 1.0' in metrics
        promtool = shutil.which("promtool")
        assert promtool, "promtool is missing: install Debian's prometheus (scripts/test.sh does)"
        checked = subprocess.run(
            [promtool, "check", "metrics"], input=metrics, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_ack_and_silence_api(engine) -> None:
    alerts = Engine(engine, "FatalXid")
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(79, T0, "x")])
    (row,) = alerts.run(T0 + 1)
    app = create_app(engine, ui=False, health=None, rollups=False, alerting=None)
    with TestClient(app) as client:
        acked = client.post(
            f"/api/v1/alerts/{row['id']}/ack", json={"by": "ana", "comment": "on it"}
        )
        assert acked.status_code == 200, acked.text
        assert (acked.json()["acked_by"], acked.json()["ack_comment"]) == ("ana", "on it")
        again = client.post(f"/api/v1/alerts/{row['id']}/ack", json={"by": "bo"}).json()
        assert again["acked_by"] == "ana"  # the first acknowledgement stands
        assert client.post("/api/v1/alerts/999999/ack", json={"by": "x"}).status_code == 404
        assert client.post(f"/api/v1/alerts/{row['id']}/ack", json={}).status_code == 422

        made = client.post(
            "/api/v1/silences",
            json={
                "matchers": [{"name": "run", "value": "r1"}],
                "duration_s": 3600,
                "created_by": "ana",
                "comment": "maintenance",
            },
        )
        assert made.status_code == 201, made.text
        silence = made.json()
        assert silence["active"] and silence["ends_at"] - silence["starts_at"] == pytest.approx(
            3600
        )
        assert [s["id"] for s in client.get("/api/v1/silences").json()] == [silence["id"]]
        ended = client.delete(f"/api/v1/silences/{silence['id']}").json()
        assert not ended["active"]
        assert client.get("/api/v1/silences").json() == []
        assert len(client.get("/api/v1/silences", params={"expired": True}).json()) == 1
        for bad, word in [
            ({"matchers": [], "duration_s": 60, "created_by": "a", "comment": "c"}, "matchers"),
            (
                {
                    "matchers": [{"name": "run", "value": "("}],
                    "regex": True,
                    "duration_s": 60,
                    "created_by": "a",
                    "comment": "c",
                },
                "regex",
            ),
            (
                {
                    "matchers": [{"name": "run", "value": "(", "regex": True}],
                    "duration_s": 60,
                    "created_by": "a",
                    "comment": "c",
                },
                "regular expression",
            ),
            (
                {
                    "matchers": [{"name": "run", "value": ".*", "regex": True}],
                    "duration_s": 60,
                    "created_by": "a",
                    "comment": "c",
                },
                "every alert",
            ),
            (
                {"matchers": [{"name": "run", "value": "r1"}], "created_by": "a", "comment": "c"},
                "duration_s",
            ),
        ]:
            resp = client.post("/api/v1/silences", json=bad)
            assert resp.status_code == 422 and word in resp.text, (bad, resp.text)
    alerts.run(T0 + 20)
    assert alerts.run(T0 + 3700)[0]["state"] == "resolved"
    with TestClient(
        create_app(engine, ui=False, health=None, rollups=False, alerting=None)
    ) as client:
        resolved = client.post(f"/api/v1/alerts/{row['id']}/ack", json={"by": "x"})
        assert resolved.status_code == 409


def test_health_states_drive_the_rank_hung_rule(engine) -> None:
    alerts = Engine(engine, "RankHung")
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(i) for i in range(10)])
    send(engine, rank=0, at=T0 + 20, steps=[step(10)])
    send(engine, rank=1, at=T0 + 20)  # alive, no progress
    flush(engine, now=T0 + 20, grace_s=0)
    with write(engine) as conn:
        evaluate(conn, now=T0 + 20, settings=HealthSettings())
    (row,) = alerts.run(T0 + 20)
    assert (row["rank"], row["state"]) == (1, "pending")  # for: 1m
    send(engine, rank=0, at=T0 + 81)
    send(engine, rank=1, at=T0 + 81)
    with write(engine) as conn:
        evaluate(conn, now=T0 + 81, settings=HealthSettings())
    (row,) = alerts.run(T0 + 81)
    assert row["state"] == "firing" and "culprit" in row["annotations"]["description"]


def test_two_collectors_evaluating_at_once_page_once(engine) -> None:
    """Two engines (two collectors) on one database: one pass at a time (an advisory
    lock on PostgreSQL, the write lock on SQLite), so one alert row and one page."""
    import threading

    first, second = Engine(engine, "FatalXid"), Engine(engine, "FatalXid")
    second.sent = first.sent  # one pager
    second.restart()
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(79, T0, "x")])
    for t in (T0 + 1, T0 + 2, T0 + 3):
        threads = [
            threading.Thread(target=e.alerts.run_once, kwargs={"now": t}) for e in (first, second)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    with engine.connect() as conn:
        assert conn.execute(select(m.alerts.c.id)).scalars().all() != []
        assert len(conn.execute(select(m.alerts.c.id)).scalars().all()) == 1
    assert [n.status for n in first.sent] == ["firing"]


def test_a_pass_reads_a_rolled_up_step_once_and_again_when_its_rollup_changes(engine) -> None:
    """The engine keeps rolled-up steps' rank rows between passes (a rank-scoped rule's
    window at 4,096 ranks is 82,000 rows a pass): a cached step is not read again until
    a late row rolls it up again; a step still arriving is read on every pass."""
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(n) for n in (1, 2, 3)])
    send(engine, rank=0, at=T0, steps=[step(4)])  # rank 1's step 4 comes late
    flush(engine, now=T0 + 10, grace_s=0)
    send(engine, rank=0, at=T0 + 11, steps=[step(5)])  # not rolled up yet
    cols = ("compute_s", "duration_s")
    cache: dict[int, Any] = {}

    def read(**kw: Any) -> list[tuple[int, int, float]]:
        with engine.connect() as conn:
            run_id = conn.execute(select(m.runs.c.id)).scalar_one()
            rows = recent_steps(conn, run_id, since=1, cols=cols, **kw)
        return [(r["step"], r["rank"], r["duration_s"]) for r in rows]

    first = read(cache=cache)
    assert (
        first
        == read()
        == [(2, 0, 0.1), (2, 1, 0.1), (3, 0, 0.1), (3, 1, 0.1), (4, 0, 0.1), (5, 0, 0.1)]
    )
    (run_cache,) = cache.values()
    assert sorted(run_cache.steps) == [2, 3, 4]  # rolled up; step 5 is still arriving
    # A cached step is not read again: a change behind the rollup's back does not show...
    with write(engine) as conn:
        conn.execute(
            update(m.rank_steps).where(m.rank_steps.c.step.in_((3, 5))).values(duration_s=0.2)
        )
    assert read(cache=cache) == [*first[:2], (3, 0, 0.1), (3, 1, 0.1), (4, 0, 0.1), (5, 0, 0.2)]
    assert read()[2:4] == [(3, 0, 0.2), (3, 1, 0.2)]
    # ...but a late row that rolls its step up again does, and steps leave the window.
    send(engine, rank=1, at=T0 + 12, steps=[step(4, duration=0.3)])
    flush(engine, now=T0 + 20, grace_s=0)
    assert (4, 1, 0.3) in read(cache=cache)
    with engine.connect() as conn:
        run_id = conn.execute(select(m.runs.c.id)).scalar_one()
        recent_steps(conn, run_id, since=3, cols=cols, cache=cache)
    assert sorted(cache[run_id].steps) == [4, 5]
    # Peer rules read rolled-up steps only: step 6, still arriving, is not read at all.
    send(engine, rank=0, at=T0 + 21, steps=[step(6)])
    settled = read(cache=cache, arriving=False)
    assert {st for st, _, _ in settled} == {2, 3, 4, 5} and settled == read(arriving=False)
    assert (6, 0, 0.1) in read(cache=cache)


def test_a_rank_rule_that_must_hold_for_minutes_is_evaluated_every_for_over_20_s(engine) -> None:
    alerts = Engine(engine, "DataLoaderStall", "Straggler")
    assert alerts.alerts.period_s(RULES["DataLoaderStall"]) == 15.0  # for: 5m
    assert alerts.alerts.period_s(RULES["Straggler"]) == 2.0  # a peer rule: every pass
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(n, duration=1.0) for n in range(1, 21)])
    assert alerts.run(T0 + 1) == []  # evaluated: all fed
    for rank in (0, 1):  # rank 1 now waits half of each step for its input
        stalled = [step(n, duration=1.0, wait=0.5 if rank else 0.01) for n in range(21, 46)]
        send(engine, rank=rank, at=T0 + 2, steps=stalled)
    assert alerts.run(T0 + 3) == []  # not due again before T0 + 16
    assert alerts.run(T0 + 15.9) == []
    (row,) = alerts.run(T0 + 16)
    assert (row["rule"], row["state"], row["rank"]) == ("DataLoaderStall", "pending", 1)
    assert alerts.run(T0 + 18) == [row]  # not evaluated, left as it was
    # A pass without the slow rule reads the peer rule's 8 steps of every rank, not
    # DataLoaderStall's 20 (with its columns: the rows kept between passes serve both).
    engine_ = alerts.alerts
    both = engine_._needs_of_due([RULES["DataLoaderStall"], RULES["Straggler"]])
    peer = engine_._needs_of_due([RULES["Straggler"]])
    assert (both.steps_back, peer.steps_back) == (20, 8)
    # Rolled-up steps only, for both: the peer rule's way, and a rule evaluated every 15 s
    # gains nothing from steps still arriving (read again on every evaluation).
    assert not both.steps_arriving and not peer.steps_arriving
    assert peer.step_cols == both.step_cols >= {"data_wait_s", "compute_s"}
    # A rank rule evaluated every pass (a `for` of steps) reads the steps still arriving.
    quick = parse_rule(
        {
            "name": "QuickStall",
            "kind": "threshold",
            "summary": "A rank waits for its input.",
            "severity": "warning",
            "runbook": "DataLoaderStall.md",
            "params": {
                "scope": "rank",
                "metric": "data_wait",
                "fraction_of_step": True,
                "window": "5 steps",
                "above": 0.2,
            },
            "for": "5 steps",
        }
    )
    assert engine_.period_s(quick) == engine_.settings.interval_s
    assert engine_._needs_of_due([quick, RULES["DataLoaderStall"]]).steps_arriving


def test_a_run_rule_on_p99_sees_the_tail_the_median_hides(engine) -> None:
    def rule(stat: str) -> Any:
        return parse_rule(
            {
                "name": f"SlowTail{stat}",
                "kind": "threshold",
                "summary": "The slowest ranks' step time.",
                "severity": "warning",
                "runbook": "Straggler.md",
                "params": {"scope": "run", "metric": "step_time", "stat": stat, "above": 0.5},
            }
        )

    for rank in range(4):  # one rank of four takes 1 s: p99 0.97 s, median 0.1 s
        send(engine, rank=rank, world=4, at=T0, steps=[step(1, duration=1.0 if rank == 3 else 0.1)])
    flush(engine, now=T0 + 1, grace_s=0)
    alerts = AlertEngine(
        engine, [rule("p99"), rule("median")], external_url=EXTERNAL, submit=lambda _: None
    )
    alerts.run_once(now=T0 + 2)
    with engine.connect() as conn:
        found = conn.execute(select(m.alerts.c.rule, m.alerts.c.value)).all()
    assert [(name, round(value, 3)) for name, value in found] == [("SlowTailp99", 0.973)]


def test_rank_dead_does_not_page_for_a_collector_too_busy_to_take_the_ranks_requests(
    engine,
) -> None:
    alerts = Engine(engine, "RankDead")
    alerts.pressure = pressure = Pressure(lambda: 0.0)
    alerts.restart()
    now = time.time()  # the refusals are stamped with the wall clock
    for rank in (0, 1):
        send(engine, rank=rank, at=now - 10, steps=[step(0)])
    send(engine, rank=0, at=now, steps=[step(1)])
    pressure.refused("r1/1")  # rank 1's latest request was refused (503): it is alive
    assert alerts.run(now + 1) == []  # 11 s since rank 1 was last stored
    send(engine, rank=0, at=now + 3, steps=[step(2)])
    # Nothing from rank 1 since, taken or refused: dead after 2.25 beats, plus the 1 s
    # by which rank 0 last arrived later than its heartbeat (the collector was behind).
    assert alerts.run(now + 5) == []
    (row,) = alerts.run(now + 6)
    assert (row["rule"], row["rank"], row["state"]) == ("RankDead", 1, "firing")


def test_a_firing_alert_whose_value_alone_moves_is_rewritten_every_refresh_s(engine) -> None:
    """A dead rank's silence grows on every pass: its RankDead alert is written when it
    fires, then every ``refresh_s``, not on every pass (a crashed run of 16,384 ranks)."""
    alerts = Engine(engine, "RankDead", refresh_s=30.0)
    world = 8
    for rank in range(world):
        send(engine, rank=rank, world=world, at=T0, steps=[step(0)])
    fired = alerts.run(T0 + 10)
    assert len(fired) == world and {r["state"] for r in fired} == {"firing"}
    assert {r["updated_at"] for r in fired} == {T0 + 10} and {r["value"] for r in fired} == {10.0}

    def fields(rows):
        return [
            (r["rank"], r["value"], r["annotations"]["description"], r["updated_at"]) for r in rows
        ]

    assert fields(alerts.run(T0 + 12)) == fields(alerts.run(T0 + 39)) == fields(fired)
    later = alerts.run(T0 + 40)  # 30 s on: every alert's value and description, in one statement
    assert {(r["value"], r["updated_at"]) for r in later} == {(40.0, T0 + 40)}
    assert all("no heartbeat for 40.0s" in r["annotations"]["description"] for r in later)
    # A change of state is written at once: ranks 0-3 are back, their alerts resolve.
    for rank in range(4):
        send(engine, rank=rank, world=world, at=T0 + 41, steps=[step(1)])
    back = {r["rank"]: r for r in alerts.run(T0 + 41)}
    assert [back[r]["state"] for r in range(world)] == ["resolved"] * 4 + ["firing"] * 4


def test_a_whole_job_back_resolves_its_alerts_in_one_statement(engine) -> None:
    """Every rank of a dead job back at once (the job restarted): its RankDead alerts all
    resolve in one pass, written by one UPDATE for the resolve and one for the resolved
    notification, not two a rank (16,384 ranks at a restart)."""
    alerts = Engine(engine, "RankDead")
    world = 40
    for rank in range(world):
        send(engine, rank=rank, world=world, at=T0, steps=[step(0)])
    assert {r["state"] for r in alerts.run(T0 + 10)} == {"firing"}
    for rank in range(world):
        send(engine, rank=rank, world=world, at=T0 + 11, steps=[step(1)])
    written: list[str] = []

    def count(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith(("UPDATE ALERTS", "DELETE FROM ALERTS")):
            written.append(statement)

    sa_event.listen(engine, "before_cursor_execute", count)
    try:
        rows = alerts.run(T0 + 11)
    finally:
        sa_event.remove(engine, "before_cursor_execute", count)
    assert [r["state"] for r in rows] == ["resolved"] * world
    assert len(written) == 2, written
    assert "resolved_at" in written[0] and "notified" in written[1], written


def test_a_run_silent_for_a_minute_is_evaluated_every_silent_every_s(engine) -> None:
    alerts = Engine(engine, "RankDead", refresh_s=0.0, silent_run_s=60.0, silent_every_s=30.0)
    for rank in (0, 1):
        send(engine, rank=rank, at=T0, steps=[step(0)])

    def values(now: float) -> list[tuple[str, float]]:
        return [(r["state"], r["value"]) for r in alerts.run(now)]

    assert values(T0 + 10) == [("firing", 10.0)] * 2
    assert values(T0 + 59) == [("firing", 59.0)] * 2  # silent for less than a minute
    assert values(T0 + 61) == [("firing", 61.0)] * 2  # silent: evaluated now, then every 30 s
    assert values(T0 + 75) == [("firing", 61.0)] * 2  # sat out: its alerts left as they are
    assert values(T0 + 91) == [("firing", 91.0)] * 2
    send(engine, rank=0, at=T0 + 95, steps=[step(1)])  # heard again: evaluated on every pass
    assert values(T0 + 96) == [("resolved", 91.0), ("firing", 96.0)]


def test_a_job_that_dies_whole_is_one_page_not_one_a_rank(engine) -> None:
    alerts = Engine(engine, "RankDead")
    world = 24
    for rank in range(world):
        send(engine, rank=rank, world=world, at=T0, steps=[step(0)])
    send(engine, rank=23, world=world, at=T0 + 9, steps=[step(1)])
    rows = alerts.run(T0 + 10)  # ranks 0-22 silent for 10 s; rank 23 beats on
    assert sorted(r["rank"] for r in rows if r["state"] == "firing") == list(range(23))
    (page,) = alerts.sent  # one page, the alerts stay one a rank
    assert page.status == "firing" and page.annotations["alerts"] == "23"
    assert page.labels["alertname"] == "RankDead" and page.labels["run"] == "r1"
    assert page.labels["grouped"] == "true" and {"rank", "node"}.isdisjoint(page.labels)
    assert page.annotations["summary"] == "RankDead on 23 ranks (0-22) of run r1"
    assert "runbook_url" in page.annotations
    for rank in range(world):  # back
        send(engine, rank=rank, world=world, at=T0 + 11, steps=[step(2)])
    alerts.run(T0 + 11)
    fired, resolved = alerts.sent
    assert resolved.status == "resolved" and resolved.fingerprint == fired.fingerprint
    assert resolved.labels == fired.labels  # Alertmanager knows an alert by its labels


def test_a_few_ranks_page_one_by_one() -> None:
    from trainwarden.alerts import Notification
    from trainwarden.alerts.grouping import grouped

    def note(rank: int, rule: str = "RankDead") -> Notification:
        return Notification(
            alert_id=rank,
            fingerprint=f"f{rank}",
            status="firing",
            labels={"alertname": rule, "run": "r", "rank": str(rank)},
            annotations={"summary": "s"},
            starts_at=T0,
            ends_at=None,
        )

    few = [note(r) for r in range(3)] + [note(r, "RankHung") for r in range(3)]
    assert grouped(few, over=3) == few
    many = [note(r) for r in (*range(0, 8), 9, *range(16, 40))]
    (one,) = grouped(many, over=3)
    assert one.annotations["summary"] == "RankDead on 33 ranks (0-7, 9, 16-39) of run r"
    assert one.alert_id == 0 and one.annotations["alerts"] == "33"
    assert one.labels == {"alertname": "RankDead", "run": "r", "grouped": "true"}


def test_a_storm_over_several_passes_pages_once_and_resolves_once(engine) -> None:
    # A node's ranks send on their own: they go silent a few seconds apart, and their
    # dead verdicts fall into different passes.
    alerts = Engine(engine, "RankDead")
    world = 9  # rank 8 beats on throughout

    def beat(ranks: range | list[int], at: float, n: int) -> None:
        for rank in ranks:
            send(engine, rank=rank, world=world, at=at, steps=[step(n)], node="node0")

    beat(range(9), T0, 0)
    beat(range(5, 9), T0 + 3, 1)
    alerts.run(T0 + 5)  # ranks 0-4 silent for 5 s: dead
    (page,) = alerts.sent
    assert page.annotations["summary"] == "RankDead on 5 ranks (0-4) of run r1"
    beat([8], T0 + 7, 2)
    with write(engine) as conn:  # someone silences rank 2's alert: it is not paged again
        conn.execute(
            insert(m.silences).values(
                matchers=[{"name": "rank", "value": "2", "regex": False}],
                starts_at=T0,
                ends_at=T0 + 100,
                created_by="me",
                comment="known",
                created_at=T0,
            )
        )
    alerts.run(T0 + 8)  # ranks 5-7 now too: they join the page, which is sent again
    (_, update) = alerts.sent
    assert update.fingerprint == page.fingerprint and update.labels == page.labels
    assert update.status == "firing" and update.annotations["alerts"] == "7"
    assert update.annotations["summary"] == "RankDead on 7 ranks (0-1, 3-7) of run r1"

    # Back a few at a time: nothing until the last, then the page resolves.
    for i, back in enumerate(([0, 1, 2], [3, 4, 5], [6, 7])):
        beat([*back, 8], T0 + 9 + i, 3 + i)
        rows = alerts.run(T0 + 9 + i)
        assert {r["rank"] for r in rows if r["state"] == "resolved"} >= set(back)
        assert len(alerts.sent) == (2 if i < 2 else 3)
    resolved = alerts.sent[-1]
    assert resolved.status == "resolved" and resolved.fingerprint == page.fingerprint
    assert resolved.labels == page.labels
    # It names every rank paged under it (the silenced one too), not the last pass's two.
    assert resolved.annotations["summary"] == "RankDead on 8 ranks (0-7) of run r1"
    assert resolved.annotations["alerts"] == "8" and resolved.ends_at == T0 + 11
    alerts.run(T0 + 12)
    assert len(alerts.sent) == 3  # nothing is sent again
    with engine.connect() as conn:
        states = conn.execute(select(m.alerts.c.state, m.alerts.c.notified).distinct()).all()
    assert [tuple(s) for s in states] == [("resolved", "resolved")]


def test_alerts_paged_alone_resolve_alone_and_a_group_as_a_group(engine) -> None:
    alerts = Engine(engine, "RankDead")
    world = 9

    def beat(ranks: range | list[int], at: float, n: int) -> None:
        for rank in ranks:
            send(engine, rank=rank, world=world, at=at, steps=[step(n)], node="node0")

    beat(range(9), T0, 0)
    beat(range(2, 9), T0 + 3, 1)
    alerts.run(T0 + 5)  # ranks 0 and 1: too few for a group, paged one by one
    assert sorted(n.labels["rank"] for n in alerts.sent) == ["0", "1"]
    beat([8], T0 + 7, 2)
    alerts.run(T0 + 8)  # ranks 2-7: six at once, a group of their own
    fired = alerts.sent[2:]
    assert [n.annotations["alerts"] for n in fired] == ["6"]
    beat(range(9), T0 + 9, 3)
    alerts.run(T0 + 9)  # all back at once
    paged = {n.fingerprint for n in alerts.sent if n.status == "firing"}
    resolved = [n for n in alerts.sent if n.status == "resolved"]
    # Each resolved under the fingerprint it was paged under, and nothing else.
    assert sorted(n.fingerprint for n in resolved) == sorted(paged) and len(resolved) == 3


def test_a_node_that_dies_is_one_page(engine) -> None:
    alerts = Engine(engine, "RankDead")
    for rank in range(16):
        send(engine, rank=rank, world=16, at=T0, steps=[step(0)], node=f"node{rank // 8}")
    for rank in range(8):  # node1 (ranks 8-15) goes dark; node0 beats on
        send(engine, rank=rank, world=16, at=T0 + 9, steps=[step(1)], node="node0")
    rows = alerts.run(T0 + 10)
    assert sorted(r["rank"] for r in rows if r["state"] == "firing") == list(range(8, 16))
    (page,) = alerts.sent
    assert page.annotations["summary"] == "RankDead on 8 ranks (8-15) of run r1"
