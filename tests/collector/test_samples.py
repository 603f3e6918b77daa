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
