"""The alert engine on a real database (SQLite and PostgreSQL): silences and inhibition
(an alert kept but nobody paged), and the alerts API over what it stored: delivery
attempts, acknowledgements and silences."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import insert

from trainwarden.collector.alerting.notify import Attempt
from trainwarden.collector.app import create_app
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import step
from .alerting_helpers import EXTERNAL, T0, Engine, send, straggling, xid


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
