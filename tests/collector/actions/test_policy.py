"""The action engine's policy modes (SQLite and PostgreSQL): dry-run records the plan
once and does nothing, require-ack acts once its alert is acknowledged, and an operator
approves or cancels through the API."""

from __future__ import annotations

from typing import Any

from trainwarden.collector.store import models as m

from .helpers import AUTO_ROLLBACK, RUN, action, commands, events, rows, states


def test_dry_run_records_the_plan_once_and_does_nothing(cluster: Any) -> None:
    run = cluster()  # no actions file: every kind is dry-run
    run.spike()
    (planned,) = run.act()  # an alert on each rank, one rollback planned
    assert (planned["kind"], planned["mode"], planned["state"], planned["trigger"]) == (
        "rollback",
        "dry-run",
        "done",
        "rule:NonFiniteLoss",
    )
    result = planned["result"]
    assert result["dry_run"] is True and result["problem"] is None
    assert (
        result["would"]
        | {"checkpoint_step": 30, "checkpoint_path": "/ckpt/step-30.pt", "skip_from": 31}
        == result["would"]
    )
    assert states(planned) == ["proposed", "approved", "done"]
    assert (planned["finished_at"], planned["approver"]) == (run.now, None)
    for _ in range(3):  # the alerts keep firing: nothing more is planned, nothing is sent
        assert run.second() == [planned]
    assert rows(run.engine, m.agent_commands) == [] and run.board.runs == set()
    assert all(not r.restored and not r.acks for r in run.ranks)
    (ev,) = events(run.engine, "action")
    assert (
        ev["data"]
        | {"action": planned["id"], "type": "rollback", "state": "done", "mode": "dry-run"}
        == ev["data"]
    )


def test_require_ack_acts_once_its_alert_is_acknowledged(cluster: Any) -> None:
    run = cluster({"rollback": {**AUTO_ROLLBACK["rollback"], "mode": "require-ack"}})
    run.spike()
    (proposed,) = run.act()
    assert (proposed["state"], proposed["mode"], proposed["approver"]) == (
        "proposed",
        "require-ack",
        None,
    )
    for _ in range(3):
        assert [a["state"] for a in run.second()] == ["proposed"]
    assert rows(run.engine, m.agent_commands) == []
    with run.api() as client:
        acked = client.post(f"/api/v1/alerts/{proposed['alert_id']}/ack", json={"by": "ana"})
        assert acked.status_code == 200, acked.text
    (approved,) = run.act()
    assert (approved["state"], approved["approver"]) == ("approved", "ana")
    assert approved["history"][-1] == {
        "at": run.now,
        "state": "approved",
        "by": "ana",
        "detail": "its alert was acknowledged",
    }
    (executing,) = run.act()
    assert executing["state"] == "executing" and executing["plan"]["issued_at_step"] == 38
    assert "barrier_step" not in executing["plan"]  # set at commit, from the ranks' answers
    assert {r for r, cmds in run.exchange().items() if cmds} == {0, 1}


def test_approve_and_cancel_through_the_api(cluster: Any) -> None:
    run = cluster(
        {
            "rollback": {**AUTO_ROLLBACK["rollback"], "mode": "require-ack"},
            "evict": {"mode": "require-ack"},
            "stop": {"mode": "auto"},
        },
        rules=("NonFiniteLoss", "FatalXid"),
    )
    run.ranks[1].event("xid", severity="critical", code=79)
    run.spike()
    rollback, evict = run.act()
    assert (rollback["kind"], evict["kind"], evict["node"]) == ("rollback", "evict", "node1")
    assert (rollback["state"], evict["state"]) == ("proposed", "proposed")
    with run.api() as client:
        url = "/api/v1/actions/{}/{}".format
        cancelled = client.post(
            url(evict["id"], "cancel"), json={"by": "bo", "reason": "known flaky"}
        )
        assert cancelled.status_code == 200, cancelled.text
        body = cancelled.json()
        assert (body["state"], body["reason"], body["finished_at"]) == (
            "cancelled",
            "known flaky",
            run.now,
        )
        assert body["history"][-1] == {
            "at": run.now,
            "state": "cancelled",
            "by": "bo",
            "detail": "known flaky",
        }
        assert client.post(url(evict["id"], "approve"), json={"by": "bo"}).status_code == 409
        # Acknowledging its alert no longer approves it.
        assert (
            client.post(f"/api/v1/alerts/{evict['alert_id']}/ack", json={"by": "bo"}).status_code
            == 200
        )

        assert client.post(url(rollback["id"], "approve"), json={}).status_code == 422
        approved = client.post(url(rollback["id"], "approve"), json={"by": "cy", "reason": "go"})
        assert approved.status_code == 200, approved.text
        assert (approved.json()["state"], approved.json()["approver"]) == ("approved", "cy")
        again = client.post(url(rollback["id"], "approve"), json={"by": "cy"})
        assert again.status_code == 409 and "is approved" in again.json()["detail"]
        run.tick()
        assert [(a["kind"], a["state"]) for a in run.act()] == [
            ("rollback", "executing"),
            ("evict", "cancelled"),
        ]
        late = client.post(url(rollback["id"], "cancel"), json={"by": "cy"})
        assert late.status_code == 409 and "is executing" in late.json()["detail"]
        assert client.post(url(999_999, "cancel"), json={"by": "cy"}).status_code == 404

        # An approved action can still be cancelled before the engine starts it.
        stop = client.post(
            f"/api/v1/runs/{RUN}/actions", json={"kind": "stop", "by": "dee", "reason": "wrong run"}
        ).json()
        assert (stop["state"], stop["approver"]) == ("approved", "dee")
        cancelled = client.post(url(stop["id"], "cancel"), json={"by": "dee"}).json()
        assert (cancelled["state"], cancelled["reason"]) == ("cancelled", "cancelled by dee")
    run.tick()
    assert action(run, stop["id"])["state"] == "cancelled" and commands(run, stop["id"]) == []
    assert commands(run, evict["id"]) == []
    timeline = [(e["data"]["action"], e["data"]["state"]) for e in events(run.engine, "action")]
    assert [t for t in timeline if t[0] == evict["id"]] == [
        (evict["id"], "proposed"),
        (evict["id"], "cancelled"),
    ]
    assert (rollback["id"], "approved") in timeline and (stop["id"], "cancelled") in timeline
