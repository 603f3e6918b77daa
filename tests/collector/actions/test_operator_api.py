"""The operator's API of the action engine (SQLite and PostgreSQL): actions asked for,
listed and refused naming what was wrong, and the commands the agent's own ingest request
brings back."""

from __future__ import annotations

from typing import Any

from trainwarden.collector.store.db import write

from ..helpers import batch
from .helpers import AUTO_ROLLBACK, RUN, action, commands


def named(resp: Any) -> str:
    """A 422's summary of what was wrong (``field: message``)."""
    return str(resp.json()["error"])


def test_operator_actions_through_the_api(cluster: Any) -> None:
    run = cluster({**AUTO_ROLLBACK, "stop": {"mode": "auto"}}, world=3)  # evictions: dry-run
    run.train(34)
    run.ranks[2].event("shutdown", reason="finished its shard")  # not live: left out
    run.ranks[2].exit_code = 0
    run.exchange()
    run.tick()
    with run.api() as client:

        def ask(run_name: str = RUN, **body: Any) -> Any:
            body = {"by": "ana", "reason": "bad shard", **body}
            return client.post(f"/api/v1/runs/{run_name}/actions", json=body)

        made = ask(kind="rollback", checkpoint_step=20)
        assert made.status_code == 201, made.text
        rollback = made.json()
        assert (
            rollback
            | {
                "run": RUN,
                "kind": "rollback",
                "state": "approved",
                "mode": "auto",
                "trigger": "operator:ana",
                "approver": "ana",
                "alert_id": None,
                "plan": {"checkpoint_step": 20},
                "reason": "bad shard",
                "created_at": run.now,
            }
            == rollback
        )
        assert [h["state"] for h in rollback["history"]] == ["proposed", "approved"]
        (executing,) = run.act()
        plan = executing["plan"]
        assert (executing["state"], plan["checkpoint_step"], plan["issued_at_step"]) == (
            "executing",
            20,
            34,
        )
        assert plan["ranks"] == [0, 1]
        assert (
            plan["rollback"]
            | {
                "checkpoint_step": 20,
                "checkpoint_path": "/ckpt/step-20.pt",
                "skip_from": 21,
                "reason": "operator:ana: onset at step 34",
            }
            == plan["rollback"]
        )

        # The agent's own ingest request brings its commands back.
        with write(run.engine) as conn:
            client.app.state.commands.refresh(conn)  # type: ignore[attr-defined]
        answer = client.post("/api/v1/ingest", json=batch(RUN, rank=0, world_size=3))
        assert answer.status_code == 200, answer.text
        (prepare,) = answer.json()["commands"]
        assert (
            prepare
            | {"type": "rollback", "phase": "prepare", "action": rollback["id"], "attempt": 1}
            == prepare
        )
        detail = client.get(f"/api/v1/actions/{rollback['id']}").json()
        assert [
            (c["rank"], c["phase"], c["delivered_at"] is not None, c["done_at"])
            for c in detail["commands"]
        ] == [
            (0, "prepare", True, None),
            (1, "prepare", False, None),
        ]
        assert detail["commands"][0]["id"] == prepare["id"]
        assert client.post("/api/v1/ingest", json=batch(RUN, rank=0, world_size=3)).json()[
            "commands"
        ] == [prepare]

        unknown = ask(kind="rollback", checkpoint_step=25).json()
        run.tick()
        assert action(run, unknown["id"])["state"] == "approved"
        run.act()
        unknown = action(run, unknown["id"])
        assert unknown["state"] == "failed"
        assert unknown["reason"] == "no checkpoint of step 25 was reported (known: [10, 20, 30])"

        evict = ask(kind="evict", node="node1").json()
        assert (evict["state"], evict["mode"], evict["result"]) == (
            "done",
            "dry-run",
            {"dry_run": True, "would": {"node": "node1", "backend": None}, "problem": None},
        )
        dry = ask(kind="rollback", dry_run=True).json()
        assert (dry["state"], dry["result"]["would"]["checkpoint_step"]) == ("done", 30)
        stop = ask(kind="stop", rank=1).json()
        run.tick()
        run.act()
        assert [(c["rank"], c["body"]["type"]) for c in commands(run, stop["id"])] == [(1, "stop")]

        cases: list[tuple[dict[str, Any], str]] = [  # what was wrong, named
            ({"kind": "evict", "node": "node9"}, "node: no rank of run 'r1' runs on node 'node9'"),
            ({"kind": "stop", "rank": 7}, "rank: run 'r1' has no rank 7"),
            ({"kind": "evict"}, "body: Value error, an eviction names its node"),
            (
                {"kind": "stop", "checkpoint_step": 3},
                "body: Value error, checkpoint_step is for rollbacks, not a stop",
            ),
            (
                {"kind": "rollback", "checkpoint_step": -1},
                "checkpoint_step: Input should be greater than or equal to 0",
            ),
            (
                {"kind": "rollback", "node": "node1"},
                "body: Value error, node is for evictions, not a rollback",
            ),
            ({"kind": "reboot"}, "kind: Input should be 'rollback', 'evict' or 'stop'"),
            ({"kind": "stop", "force": True}, "force: Extra inputs are not permitted"),
            ({"kind": "stop", "by": ""}, "by: String should have at least 1 character"),
            ({"kind": "stop", "reason": None}, "reason: Input should be a valid string"),
        ]
        for body, problem in cases:
            resp = ask(**body)
            assert (resp.status_code, named(resp)) == (422, problem), body
        assert ask("nope", kind="stop").status_code == 404

        def listed(**params: Any) -> list[tuple[int, str, str]]:
            found = client.get("/api/v1/actions", params=params).json()
            return [(a["id"], a["kind"], a["state"]) for a in found]

        newest_first = [stop["id"], dry["id"], evict["id"], unknown["id"], rollback["id"]]
        assert [a[0] for a in listed()] == newest_first
        assert listed(run=RUN, state="failed") == [(unknown["id"], "rollback", "failed")]
        assert listed(kind="stop") == [(stop["id"], "stop", "executing")]
        assert listed(state=["done", "failed"], kind="rollback") == [
            (dry["id"], "rollback", "done"),
            (unknown["id"], "rollback", "failed"),
        ]
        assert listed(run="other") == []
        assert client.get("/api/v1/actions", params={"state": "lost"}).status_code == 422
        assert client.get("/api/v1/actions/999999").status_code == 404
