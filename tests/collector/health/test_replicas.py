"""Replica fingerprints: stored at ingest, compared within each replica group by the
health evaluator, a suspect named with where it diverged (SQLite and PostgreSQL)."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from sqlalchemy import select

from trainwarden.collector.app import create_app
from trainwarden.collector.health.replicas import GRACE_S
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step
from .replica_scenario import checked, evaluated, send

T0 = time.time() - 3600
GOOD = "0123456789abcdef" * 2
BAD = "0123456789abcdef0123456789abcdee"  # one bit off in the last word


def results(engine) -> list[tuple]:
    r = m.replica_results.c
    with engine.connect() as conn:
        return [
            (row.step, row.agree, row.suspects, row.missing)
            for row in conn.execute(select(m.replica_results).order_by(r.step))
        ]


def divergences(engine) -> list[tuple]:
    e = m.events.c
    with engine.connect() as conn:
        rows = conn.execute(
            select(e.rank, e.step, e.data).where(e.kind == "replica_divergence").order_by(e.id)
        ).all()
    return [(r.rank, r.step, r.data["last_agreed_step"], r.data["reason"]) for r in rows]


def test_the_rank_whose_parameters_left_its_replicas_is_named_with_where(engine) -> None:
    for rank in range(4):
        fps = [GOOD, GOOD, GOOD, BAD if rank == 2 else GOOD]
        send(engine, rank, [checked(10 * (i + 1), fp) for i, fp in enumerate(fps)], T0 + 1)
    evaluated(engine, T0 + 2)
    assert results(engine) == [
        (10, True, [], []),
        (20, True, [], []),
        (30, True, [], []),
        (40, False, [2], []),
    ]
    assert divergences(engine) == [
        (
            2,
            40,
            30,
            "rank 2's parameters differ from its replica group's (3 of 4 ranks of 0-3 agree) "
            "at step 40; it last agreed at step 30: diverged in steps 31-40",
        )
    ]
    evaluated(engine, T0 + 3)  # compared once
    assert len(results(engine)) == 4 and len(divergences(engine)) == 1


def test_a_rank_that_sent_none_is_left_out_not_a_suspect(engine) -> None:
    for rank in range(3):
        send(engine, rank, [checked(10, GOOD)], T0 + 1)
    evaluated(engine, T0 + 2)
    assert results(engine) == []  # waits for rank 3, for a while
    evaluated(engine, T0 + 1 + GRACE_S + 1)
    assert results(engine) == [(10, True, [], [3])]
    assert divergences(engine) == []


def test_a_step_waits_for_the_ranks_behind_though_a_later_check_came(engine) -> None:
    """Ranks send on their own schedules: ranks 1 and 2 have sent steps 10-30 while 0 and
    3 have sent step 10 only. Step 20 waits for 0 and 3 (compared without them, the pair
    of 1, which diverged, and 2 had no majority, and rank 2 was named too: in CI)."""
    for rank in (1, 2):
        fps = [GOOD, BAD if rank == 1 else GOOD, BAD if rank == 1 else GOOD]
        send(
            engine, rank, [checked(s, fp) for s, fp in zip((10, 20, 30), fps, strict=True)], T0 + 1
        )
    for rank in (0, 3):
        send(engine, rank, [checked(10, GOOD)], T0 + 1)
    evaluated(engine, T0 + 2)
    assert results(engine) == [(10, True, [], [])]
    for rank in (0, 3):
        send(engine, rank, [checked(20, GOOD), checked(30, GOOD)], T0 + 3)
    evaluated(engine, T0 + 4)
    assert results(engine) == [(10, True, [], []), (20, False, [1], []), (30, False, [1], [])]
    assert [(r, s) for r, s, _, _ in divergences(engine)] == [(1, 20), (1, 30)]


def test_a_rank_past_the_step_without_its_check_is_not_waited_for(engine) -> None:
    for rank in range(3):
        send(engine, rank, [checked(10, GOOD)], T0 + 1)
    send(engine, 3, [step(10), step(11)], T0 + 1)  # ran step 10, sent no fingerprint of it
    evaluated(engine, T0 + 2)
    assert results(engine) == [(10, True, [], [3])]  # not GRACE_S later


def test_a_group_of_two_that_disagrees_makes_both_suspects(engine) -> None:
    send(engine, 0, [checked(10, GOOD, "0-1")], T0 + 1, world=2)
    send(engine, 1, [checked(10, BAD, "0-1")], T0 + 1, world=2)
    evaluated(engine, T0 + 2)
    assert results(engine) == [(10, False, [0, 1], [])]
    assert [(r, s) for r, s, _, _ in divergences(engine)] == [(0, 10), (1, 10)]
    assert "have no majority" in divergences(engine)[0][3]


def test_groups_are_compared_apart(engine) -> None:
    # HSDP-like: ranks 0,2 hold one shard, 1,3 another; their fingerprints differ by design.
    for rank in range(4):
        group = "0-2:2" if rank % 2 == 0 else "1-3:2"
        send(engine, rank, [checked(10, GOOD if rank % 2 == 0 else BAD, group)], T0 + 1)
    evaluated(engine, T0 + 2)
    assert [(s, a) for s, a, _, _ in results(engine)] == [(10, True), (10, True)]


def test_a_replayed_step_is_compared_again_on_its_later_execution(engine) -> None:
    for rank in range(4):
        send(engine, rank, [checked(10, GOOD), checked(20, BAD if rank == 1 else GOOD)], T0 + 1)
    evaluated(engine, T0 + 2)
    assert results(engine)[-1] == (20, False, [1], [])
    # A rollback to step 10 ran step 20 again: every replica agrees now.
    for rank in range(4):
        send(engine, rank, [checked(20, GOOD, ts=T0 + 50)], T0 + 51)
    evaluated(engine, T0 + 52)
    assert results(engine)[-1] == (20, True, [], [])


def test_a_malformed_fingerprint_is_refused_naming_the_field(engine) -> None:
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as client:
        for field, value in (("fingerprint", "xyz"), ("replica_group", "0-3;7")):
            s = checked(10, GOOD)
            s[field] = value
            response = client.post("/api/v1/ingest", json=batch(rank=0, world_size=4, steps=[s]))
            assert response.status_code == 422, response.text
            assert f"steps[0].{field}" in response.text
        with engine.connect() as conn:
            assert conn.execute(select(m.replica_checks.c.rank)).all() == []
            assert conn.execute(select(m.rank_steps.c.rank)).all() == []


def test_the_alert_pages_and_a_rollback_restores_the_last_checkpoint_proven_clean(
    engine,
) -> None:
    from types import SimpleNamespace

    from trainwarden.alerts import load_rule_packs
    from trainwarden.collector.actions.policy import RollbackPolicy
    from trainwarden.collector.actions.rollback import checkpoints, rollback_plan
    from trainwarden.collector.alerting.engine import AlertEngine
    from trainwarden.collector.rollups.worker import flush

    now = time.time()
    for rank in range(4):
        saved = (
            [
                {
                    "id": f"ck{s}-{rank}",
                    "kind": "checkpoint",
                    "ts": now - 60 + s / 10,
                    "step": s,
                    "data": {"path": f"/ck/{s}.pt"},
                }
                for s in (20, 30, 40)
            ]
            if rank == 0
            else []
        )
        body = batch(
            rank=rank,
            world_size=4,
            events=saved,
            steps=[
                checked(s, BAD if rank == 2 and s == 40 else GOOD, ts=now - 60 + s / 10)
                for s in (10, 20, 30, 40)
            ],
        )
        with write(engine) as conn:
            ingest(conn, batch=IngestBatch.model_validate(body), now=now - 10)
    evaluated(engine, now - 5)
    flush(engine, now=now - 4, grace_s=0)
    rules = [r for r in load_rule_packs() if r.name == "SilentDataCorruption"]
    AlertEngine(engine, rules, external_url="http://tw", submit=lambda _: None).run_once(now=now)
    with engine.connect() as conn:
        alert = conn.execute(select(m.alerts)).one()
        assert (alert.rule, alert.state, alert.rank) == ("SilentDataCorruption", "firing", 2)
        assert alert.node == "node2"
        assert alert.annotations["clean_through"] == "30"
        assert "rank 2's parameters differ" in alert.annotations["description"]
        row = SimpleNamespace(run_id=alert.run_id, alert_id=alert.id, plan=None, trigger="SDC")
        made, why = rollback_plan(conn, row, RollbackPolicy())
        plan = made.dump() if made is not None else {}
        marks = {c["step"]: c["good"] for c in checkpoints(conn, alert.run_id, margin_steps=3)}
    assert why is None and plan["rollback"]["checkpoint_step"] == 30  # not 20 (margin), not 40
    # The parameters went wrong, not the data: the same batches, at the same rate.
    assert plan["keep_data"] and plan["rollback"]["skip_from"] == 31
    assert plan["rollback"]["skip_to"] == 30 and plan["rollback"]["lr_scale"] is None
    assert marks == {20: True, 30: True, 40: False}


def test_a_rank_not_yet_back_at_a_replayed_step_is_waited_for_not_compared(engine) -> None:
    # Found in a drill: after a rollback, three ranks' replays of step 20 arrived while
    # rank 3 (itself rolled back, at step 12 again) still had the old execution's row.
    for rank in range(4):
        send(engine, rank, [checked(10, GOOD), checked(20, BAD if rank == 1 else GOOD)], T0 + 1)
    evaluated(engine, T0 + 2)
    send(engine, 3, [step(12, duration=0.1) | {"ts": T0 + 40}], T0 + 41)  # rank 3 went back
    for rank in range(3):
        send(engine, rank, [checked(20, BAD, ts=T0 + 50)], T0 + 51)  # the replay, all alike
    evaluated(engine, T0 + 52)
    assert results(engine)[-1] == (10, True, [], [])  # step 20 waits for rank 3
    send(engine, 3, [checked(20, BAD, ts=T0 + 50.1)], T0 + 53)
    evaluated(engine, T0 + 54)
    assert results(engine)[-1] == (20, True, [], [])
    assert [(r, s) for r, s, _, _ in divergences(engine)] == [(1, 20)]  # the first execution's


def test_a_run_s_last_checks_are_compared_once_it_ended(engine) -> None:
    from sqlalchemy import update

    for rank in range(3):  # rank 3's last check never came: the run ended
        send(engine, rank, [checked(10, GOOD)], T0 + 1)
    evaluated(engine, T0 + 2)
    assert results(engine) == []  # still running: waits for rank 3
    with write(engine) as conn:
        conn.execute(update(m.runs).values(status="finished"))
    evaluated(engine, T0 + 3)
    assert results(engine) == [(10, True, [], [3])]


def test_a_batch_delivered_twice_keeps_its_comparison(engine) -> None:
    for rank in range(4):
        send(engine, rank, [checked(10, GOOD, ts=T0 + 1)], T0 + 1)
    evaluated(engine, T0 + 2)
    send(engine, 2, [checked(10, GOOD, ts=T0 + 1)], T0 + 3)  # a spooled batch, resent
    assert results(engine) == [(10, True, [], [])]


# -- determinism probes -------------------------------------------------------------------

SUMS = [1.5, 40.0, -3.25]


def probed(n: int, probe: str, sums: list[float] | None = None, rtol: float | None = None):
    s = checked(n, GOOD)
    s["probe"] = probe
    if sums is not None:
        s["probe_sums"] = sums
    if rtol is not None:
        s["probe_rtol"] = rtol
    return s


def probe_results(engine) -> list[tuple]:
    r = m.replica_results.c
    with engine.connect() as conn:
        return [
            (row.step, row.agree, row.probe_suspects, row.probes)
            for row in conn.execute(select(m.replica_results).order_by(r.step))
        ]


def test_a_rank_that_computes_differently_is_named_though_its_parameters_agree(
    engine,
) -> None:
    for rank in range(4):
        steps = [checked(5, GOOD)]  # a checked step without a probe
        steps += [probed(s, BAD if rank == 1 and s >= 20 else GOOD, SUMS) for s in (10, 20, 30)]
        send(engine, rank, steps, T0 + 1)
    evaluated(engine, T0 + 2)
    assert probe_results(engine) == [
        (5, True, None, None),
        (10, True, [], 4),
        (20, True, [1], 4),
        (30, True, [1], 4),
    ]
    e = m.events.c
    with engine.connect() as conn:
        rows = conn.execute(
            select(e.rank, e.step, e.data).where(e.kind == "replica_divergence").order_by(e.id)
        ).all()
    assert [(r.rank, r.step, r.data["check"], r.data["clean_through"]) for r in rows] == [
        (1, 20, "probe", 10),
        (1, 30, "probe", 10),
    ]
    assert rows[0].data["reason"] == (
        "rank 1 computes a different output from its replicas on the same input and "
        "parameters (3 of 4 ranks of 0-3 agree bit-exactly) at step 20: wrong arithmetic; "
        "its probe last agreed at step 10: it went wrong in steps 11-20"
    )
    from trainwarden.collector.incidents.timeline import timeline

    with engine.connect() as conn:  # the timeline (and so the post-mortem) says it
        said = [e["text"] for e in timeline(conn, run="r1", now=T0 + 3)["entries"]]
    assert f"replicas disagree (probe): {rows[0].data['reason']}" in said


def test_within_probe_rtol_replicas_agree_and_beyond_it_they_do_not(engine) -> None:
    near = [SUMS[0] + 40.0 * 1e-7, SUMS[1], SUMS[2] - 40.0 * 1e-7]  # 1e-7 of the L1 norm
    far = [SUMS[0] + 40.0 * 1e-5, SUMS[1], SUMS[2]]
    for rank in range(4):
        send(
            engine,
            rank,
            [
                probed(10, BAD if rank == 3 else GOOD, near if rank == 3 else SUMS, 1e-6),
                probed(20, BAD if rank == 3 else GOOD, far if rank == 3 else SUMS, 1e-6),
            ],
            T0 + 1,
        )
    evaluated(engine, T0 + 2)
    assert probe_results(engine) == [(10, True, [], 4), (20, True, [3], 4)]


def test_probe_suspects_by_majority_two_that_disagree_are_both_suspects() -> None:
    from trainwarden.collector.health.replicas import Probe, probe_suspects

    a, b = Probe(GOOD, SUMS, 0.0), Probe(BAD, SUMS, 0.0)
    assert probe_suspects({0: a, 1: a, 2: b}) == ([2], 2)
    assert probe_suspects({0: a, 1: b}) == ([0, 1], 0)
    assert probe_suspects({0: a, 1: b, 2: a, 3: b}) == ([0, 1, 2, 3], 0)
    assert probe_suspects({0: a}) == ([], 1)
    # With a tolerance, bits alone do not decide; without sums they must match.
    loose = Probe(BAD, [x * (1 + 1e-9) for x in SUMS], 1e-6)
    assert probe_suspects({0: a, 1: loose}) == ([], 2)
    assert probe_suspects({0: a, 1: Probe(BAD, None, 1e-6), 2: a}) == ([1], 2)


def test_a_malformed_probe_is_refused_naming_the_field(engine) -> None:
    bad = [
        ("probe", "nothex", "steps[0].probe"),
        ("probe_sums", [1.0, 2.0], "steps[0].probe_sums"),
        (
            "probe_sums",
            [1.0, "nan", 2.0],
            "steps[0].probe_sums[1]: Input should be a finite number",
        ),
        ("probe_rtol", 0.5, "steps[0].probe_rtol"),
    ]
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as client:
        for field, value, where in bad:
            s = probed(10, GOOD, SUMS)
            s[field] = value
            response = client.post("/api/v1/ingest", json=batch(rank=0, world_size=4, steps=[s]))
            assert response.status_code == 422, response.text
            assert where in response.text, (field, response.text)
        s = probed(10, GOOD, SUMS)
        del s["fingerprint"]
        for body in (
            batch(rank=0, world_size=4, steps=[s]),
            {
                "run": "r",
                "world_size": 4,
                "agents": [batch(rank=0, world_size=4)["agent"]],
                "steps": {
                    "rank": [0],
                    **{k: [v] for k, v in s.items()},
                },
            },
        ):
            path = "/api/v1/ingest" if "agent" in body else "/api/v1/ingest/columns"
            response = client.post(path, json=body)
            assert response.status_code == 422, response.text
            assert "sent without the step's fingerprint" in response.text
        with engine.connect() as conn:
            assert conn.execute(select(m.replica_checks.c.rank)).all() == []
            assert conn.execute(select(m.rank_steps.c.rank)).all() == []


def test_a_rank_whose_replay_has_not_arrived_is_waited_for_not_compared(engine) -> None:
    """Found in the demo on a loaded machine: after a rollback, rank 0's replay of step 300
    arrived while rank 1 had sent nothing since the rollback (its last step still the one
    before it, past 300). Its stored check was the first execution's, and the pair was
    compared as one that disagrees: a false SilentDataCorruption page. An execution older
    than a replay of the same step by another member is not compared: the step waits."""
    for rank in range(2):
        send(
            engine,
            rank,
            [checked(10, GOOD, "0,1", ts=T0 + 1), checked(20, GOOD, "0,1", ts=T0 + 2)]
            + [step(25) | {"ts": T0 + 3}],
            T0 + 4,
            world=2,
        )
    evaluated(engine, T0 + 5)
    assert results(engine) == [(10, True, [], []), (20, True, [], [])]
    # A rollback to step 10 after step 25: rank 0's replay of step 20 (other batches,
    # other parameters) arrives first; rank 1's has not yet.
    send(engine, 0, [checked(20, BAD, "0,1", ts=T0 + 30)], T0 + 31, world=2)
    evaluated(engine, T0 + 32)
    assert results(engine) == [(10, True, [], [])]  # step 20 waits for rank 1's replay
    # (rank 1 ran it a little before rank 0, by its clock: the same execution)
    send(engine, 1, [checked(20, BAD, "0,1", ts=T0 + 29.9)], T0 + 33, world=2)
    evaluated(engine, T0 + 34)
    assert results(engine) == [(10, True, [], []), (20, True, [], [])]
    assert divergences(engine) == []


def test_a_replay_that_never_comes_leaves_the_old_execution_out_after_the_grace(engine) -> None:
    """The rank whose replay is awaited died: after the grace the step is compared without
    its earlier execution (missing), not against it."""
    for rank in range(2):
        send(
            engine,
            rank,
            [checked(20, GOOD, "0,1", ts=T0 + 2), step(25) | {"ts": T0 + 3}],
            T0 + 4,
            world=2,
        )
    evaluated(engine, T0 + 5)
    send(engine, 0, [checked(20, BAD, "0,1", ts=T0 + 30)], T0 + 31, world=2)
    evaluated(engine, T0 + 32)
    assert results(engine) == []
    evaluated(engine, T0 + 31 + GRACE_S + 1)
    assert results(engine) == [(20, True, [], [1])]
    assert divergences(engine) == []
