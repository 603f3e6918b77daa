"""The alert engine on a real database (SQLite and PostgreSQL), with a controlled clock:
lifecycle rows and notifications (pending, firing, kept firing, resolved), resends
until acknowledged, and what survives a restart."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import insert, update

from trainwarden.collector.health.evaluator import evaluate
from trainwarden.collector.health.settings import HealthSettings
from trainwarden.collector.rollups.worker import flush
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step
from .alerting_helpers import EXTERNAL, T0, Engine, send, straggling, xid


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


def test_state_survives_a_restart_of_the_engine(engine) -> None:
    alerts = Engine(engine, "FatalXid")
    send(engine, rank=0, at=T0, steps=[step(1)], events=[xid(79, T0, "x")])
    (before,) = alerts.run(T0 + 1)
    alerts.restart()
    (after,) = alerts.run(T0 + 5)
    assert after["id"] == before["id"] and after["fired_at"] == before["fired_at"]
    assert len(alerts.sent) == 1  # not paged again by the new process


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
