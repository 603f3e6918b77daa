"""Sample digests: stored at ingest (a replay keeps the first execution's), compared
within each data-parallel group by the health evaluator, one duplicate_batch event per
set of ranks (SQLite and PostgreSQL); bad digests refused naming the field."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from trainwarden.collector.app import create_app
from trainwarden.collector.store import models as m

from .helpers import batch, step
from .test_replicas import checked, evaluated, send

T0 = time.time() - 3600


def sampled(n: int, digest: str, **more: Any) -> dict[str, Any]:
    s = step(n)
    s.update(samples_digest=digest, samples_count=32, **more)
    return s


def dup_events(engine) -> list[tuple]:
    e = m.events.c
    with engine.connect() as conn:
        rows = conn.execute(
            select(e.rank, e.step, e.data).where(e.kind == "duplicate_batch").order_by(e.id)
        ).all()
    return [(r.step, r.data["ranks"], r.data["replica_group"], r.data["reason"]) for r in rows]


def own(rank: int, n: int) -> str:
    return f"{rank:04x}{n:012x}"


def test_ranks_on_one_batch_are_named_once_with_the_first_step(engine) -> None:
    for rank in range(4):
        # From step 20 on, ranks 1 and 3 draw rank 0's batch (ranks 0, 1, 3 share it).
        steps = [
            sampled(n, own(0 if rank in (1, 3) and n >= 20 else rank, n)) for n in (10, 20, 30)
        ]
        send(engine, rank, steps, T0 + 1)
    evaluated(engine, T0 + 2)
    evaluated(engine, T0 + 3)  # the same finding is not said twice
    from trainwarden.collector.incidents.timeline import timeline

    with engine.connect() as conn:  # the timeline (and so the post-mortem) says it
        said = [e["text"] for e in timeline(conn, run="r1", now=T0 + 4)["entries"]]
    assert f"same batch on several ranks: {dup_events(engine)[0][3]}" in said
    assert dup_events(engine) == [
        (
            20,
            [0, 1, 3],
            "0-3",
            "ranks 0,1,3 of data-parallel group 0-3 trained on the same batch (equal sample "
            "digests) at step 20: the effective batch is smaller than it should be",
        )
    ]


def test_the_groups_are_the_replica_groups_tensor_parallel_peers_may_share(engine) -> None:
    # 4 ranks: 2-way tensor parallel (0,1 and 2,3 share a batch) x 2-way data parallel
    # (groups 0,2 and 1,3): equal digests across groups are expected, within one are not.
    for rank in range(4):
        group = "0,2" if rank % 2 == 0 else "1,3"
        tp = rank // 2  # the data-parallel replica index: peers 0,1 and 2,3 share data
        steps = [checked(10, "0123456789abcdef" * 2, group=group)]
        steps += [sampled(n, own(tp if n < 30 else 0, n)) for n in (10, 20, 30)]
        send(engine, rank, steps, T0 + 1)
    evaluated(engine, T0 + 2)
    assert [(s, r, g) for s, r, g, _ in dup_events(engine)] == [
        (30, [0, 2], "0,2"),
        (30, [1, 3], "1,3"),
    ]


def test_a_replay_keeps_the_first_execution_s_digest(engine) -> None:
    send(engine, 0, [sampled(5, own(0, 5))], T0 + 1)
    replay = sampled(5, own(9, 5))
    replay["ts"] = T0 + 100
    send(engine, 0, [replay], T0 + 101)
    stale = sampled(5, own(7, 5))  # an older execution delivered late changes nothing
    stale["ts"] = T0 + 50
    send(engine, 0, [stale], T0 + 102)
    d = m.sample_digests.c
    with engine.connect() as conn:
        assert conn.execute(select(d.digest, d.first_digest, d.count)).all() == [
            (own(9, 5), own(0, 5), 32)
        ]


def test_a_malformed_digest_is_refused_naming_the_field(engine) -> None:
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as client:
        for field, value in (
            ("samples_digest", "ABCDEF0123456789"),
            ("samples_digest", "0123"),
            ("samples_count", -1),
            ("samples_count", 70_000),
        ):
            s = sampled(10, own(0, 10))
            s[field] = value
            response = client.post("/api/v1/ingest", json=batch(rank=0, world_size=4, steps=[s]))
            assert response.status_code == 422, response.text
            assert f"steps[0].{field}" in response.text
        with engine.connect() as conn:
            assert conn.execute(select(m.sample_digests.c.rank)).all() == []
            assert conn.execute(select(m.rank_steps.c.rank)).all() == []


def test_a_step_is_decided_once_its_whole_group_is_in_or_after_the_grace(engine) -> None:
    from trainwarden.collector.health.samples import GRACE_S

    for rank in (1, 3):  # first in: two of four, on rank 0's batch
        send(engine, rank, [sampled(20, own(0, 20))], T0 + 1)
    evaluated(engine, T0 + 2)
    assert dup_events(engine) == []  # not yet: a partial set would be named
    for rank in (0, 2):
        send(engine, rank, [sampled(20, own(0, 20))], T0 + 3)
    evaluated(engine, T0 + 4)
    assert [(s, r) for s, r, _, _ in dup_events(engine)] == [(20, [0, 1, 2, 3])]
    send(engine, 1, [sampled(30, own(0, 30))], T0 + 5)  # rank 1 alone, the others silent
    send(engine, 3, [sampled(30, own(0, 30))], T0 + 5)
    evaluated(engine, T0 + 5 + GRACE_S)
    assert [(s, r) for s, r, _, _ in dup_events(engine)] == [(20, [0, 1, 2, 3]), (30, [1, 3])]


# -- resume drift ----------------------------------------------------------------------------


def drift_events(engine) -> list[tuple]:
    e = m.events.c
    with engine.connect() as conn:
        rows = conn.execute(
            select(e.step, e.data).where(e.kind == "data_order_drift").order_by(e.id)
        ).all()
    return [(r.step, r.data["ranks"], r.data["refed"], r.data["reason"]) for r in rows]


def first_run(engine, world: int = 2, steps: int = 10) -> None:
    """Steps 0..steps-1 of ``world`` ranks, each batch its own digest; attempt 1."""
    for rank in range(world):
        send(
            engine,
            rank,
            [sampled(n, own(rank, n), ts=T0 + n) for n in range(steps)],
            T0 + 20,
            world=world,
        )
    with write_engine(engine) as conn:
        run_id = conn.execute(select(m.runs.c.id)).scalar_one()
        conn.execute(
            m.attempts.insert(),
            [{"run_id": run_id, "number": 1, "started_at": T0, "world_size": world, "nodes": []}],
        )


def second_attempt(engine, world: int = 2) -> None:
    with write_engine(engine) as conn:
        run_id = conn.execute(select(m.runs.c.id)).scalar_one()
        conn.execute(
            m.attempts.insert(),
            [
                {
                    "run_id": run_id,
                    "number": 2,
                    "started_at": T0 + 50,
                    "world_size": world,
                    "nodes": [],
                }
            ],
        )


def replay(
    engine,
    ranks: range,
    steps: range,
    batch_of: Any,
    at: float = T0 + 60,
    world: int | None = None,
) -> None:
    for rank in ranks:
        send(
            engine,
            rank,
            [sampled(n, own(rank, batch_of(n)), ts=at + n) for n in steps],
            at + 20,
            world=world or len(ranks),
        )


def write_engine(engine):  # type: ignore[no-untyped-def]
    from trainwarden.collector.store.db import write

    return write(engine)


def test_a_resume_that_restarts_the_sampler_is_named_at_its_first_step_as_re_fed(engine) -> None:
    first_run(engine)
    second_attempt(engine)
    replay(engine, range(2), range(6, 10), lambda n: n - 6)  # the sampler back at batch 0
    evaluated(engine, T0 + 81)
    evaluated(engine, T0 + 82)
    assert drift_events(engine) == [
        (
            6,
            [0, 1],
            {"0": 0, "1": 0},
            "step 6 ran again on ranks 0,1 with other samples than its first execution: "
            "re-fed (batches they had trained on at earlier steps: rank 0 the batch of step "
            "0, rank 1 the batch of step 0); the data left its path at step 6",
        )
    ]
    from trainwarden.collector.incidents.timeline import timeline

    with engine.connect() as conn:
        said = [e["text"] for e in timeline(conn, run="r1", now=T0 + 83)["entries"]]
    assert f"data left its path: {drift_events(engine)[0][3]}" in said


def test_a_resume_on_its_path_and_a_new_order_are_told_apart(engine) -> None:
    first_run(engine)
    second_attempt(engine)
    replay(engine, range(2), range(6, 8), lambda n: n)  # restored exactly: no drift
    evaluated(engine, T0 + 81)
    assert drift_events(engine) == []
    replay(engine, range(2), range(8, 10), lambda n: n + 100, at=T0 + 90)  # skipped ahead
    evaluated(engine, T0 + 111)
    ((step, ranks, refed, reason),) = drift_events(engine)
    assert (step, ranks, refed) == (8, [0, 1], {})
    assert "out of order (batches not trained on before" in reason


def test_declared_differences_are_not_drift(engine) -> None:
    # A rollback that skipped data: its replays train on later batches on purpose.
    first_run(engine)
    with write_engine(engine) as conn:
        run_id = conn.execute(select(m.runs.c.id)).scalar_one()
        plan = {
            "committed_at": T0 + 55,
            "rollback": {"checkpoint_step": 5, "skip_from": 6, "skip_to": 12},
        }
        conn.execute(
            m.actions.insert(),
            [
                {
                    "run_id": run_id,
                    "kind": "rollback",
                    "state": "done",
                    "mode": "auto",
                    "trigger": "rule:LossSpike",
                    "plan": plan,
                    "history": [],
                    "created_at": T0 + 50,
                    "updated_at": T0 + 60,
                }
            ],
        )
    replay(engine, range(2), range(6, 10), lambda n: n + 7)
    evaluated(engine, T0 + 81)
    assert drift_events(engine) == []


def test_a_new_world_size_is_a_declared_re_shard(engine) -> None:
    first_run(engine, world=2)
    second_attempt(engine, world=1)  # one rank left: it takes the whole data
    replay(engine, range(1), range(6, 10), lambda n: 2 * n)
    evaluated(engine, T0 + 81)
    assert drift_events(engine) == []


def test_a_run_that_ended_before_an_evaluation_is_still_checked(engine) -> None:
    from sqlalchemy import update

    first_run(engine)
    second_attempt(engine)
    replay(engine, range(1), range(6, 8), lambda n: n - 6, world=2)  # rank 1's never came
    evaluated(engine, T0 + 81)
    assert drift_events(engine) == []  # running: waits for rank 1's digest of step 6
    with write_engine(engine) as conn:
        conn.execute(update(m.runs).values(status="finished"))
    evaluated(engine, T0 + 82)
    assert [(s, r, f) for s, r, f, _ in drift_events(engine)] == [(6, [0], {"0": 0})]
