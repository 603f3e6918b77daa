"""Sample digests: stored at ingest (a replay keeps the first execution's), compared
within each data-parallel group by the health evaluator, one duplicate_batch event per
set of ranks (SQLite and PostgreSQL); bad digests refused naming the field."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from trainwarden.collector.app import create_app
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.store import models as m

from ..helpers import batch, step
from .replica_scenario import checked, evaluated, send

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
    new_attempt(engine, world=world, number=1, at=T0)


def new_attempt(engine, world: int = 2, number: int = 2, at: float = T0 + 50) -> None:
    """Attempt ``number`` started ``at`` on ``world`` ranks (by default the second)."""
    with write_engine(engine) as conn:
        run_id = conn.execute(select(m.runs.c.id)).scalar_one()
        conn.execute(
            m.attempts.insert(),
            [
                {
                    "run_id": run_id,
                    "number": number,
                    "started_at": at,
                    "world_size": world,
                    "nodes": [],
                }
            ],
        )


def rolled_back(engine, plan: dict[str, Any]) -> None:
    """A loss-spike rollback, done, with ``plan``."""
    with write_engine(engine) as conn:
        run_id = conn.execute(select(m.runs.c.id)).scalar_one()
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
    new_attempt(engine)
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
    new_attempt(engine)
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
    plan = {
        "committed_at": T0 + 55,
        "rollback": {"checkpoint_step": 5, "skip_from": 6, "skip_to": 12},
    }
    rolled_back(engine, plan)
    replay(engine, range(2), range(6, 10), lambda n: n + 7)
    evaluated(engine, T0 + 81)
    assert drift_events(engine) == []


def test_a_new_world_size_is_a_declared_re_shard(engine) -> None:
    first_run(engine, world=2)
    new_attempt(engine, world=1)  # one rank left: it takes the whole data
    replay(engine, range(1), range(6, 10), lambda n: 2 * n)
    evaluated(engine, T0 + 81)
    assert drift_events(engine) == []


def test_a_run_that_ended_before_an_evaluation_is_still_checked(engine) -> None:
    from sqlalchemy import update

    first_run(engine)
    new_attempt(engine)
    replay(engine, range(1), range(6, 8), lambda n: n - 6, world=2)  # rank 1's never came
    evaluated(engine, T0 + 81)
    assert drift_events(engine) == []  # running: waits for rank 1's digest of step 6
    with write_engine(engine) as conn:
        conn.execute(update(m.runs).values(status="finished"))
    evaluated(engine, T0 + 82)
    assert [(s, r, f) for s, r, f, _ in drift_events(engine)] == [(6, [0], {"0": 0})]


def test_a_replay_longer_than_the_window_is_one_event_at_its_first_step(engine) -> None:
    from trainwarden.collector.health.samples import WINDOW_S

    first_run(engine)
    new_attempt(engine)
    replay(engine, range(2), range(6, 7), lambda n: n - 6)  # arrives at T0 + 80
    evaluated(engine, T0 + 81)
    # The replay goes on; its step 6 rows leave the evaluator's window.
    later = T0 + 80 + WINDOW_S + 40
    replay(engine, range(2), range(7, 10), lambda n: n - 6, at=later - 20)
    evaluated(engine, later + 1)
    evaluated(engine, later + 2)
    assert [(s, r, f) for s, r, f, _ in drift_events(engine)] == [(6, [0, 1], {"0": 0, "1": 0})]


@pytest.mark.parametrize("restored", [False, True])
def test_a_rollback_s_exemption_ends_with_its_replay(engine, restored: bool) -> None:
    first_run(engine)  # steps 0-9, attempt 1
    # A loss-spike rollback restored step 5 after step 9, skipping batches 6-12: its
    # replay of 6-9 trains on batches 13-16 on purpose, then it goes on to step 15.
    rolled_back(
        engine,
        {
            "committed_at": T0 + 55,
            "barrier_step": 9,
            "rollback": {"checkpoint_step": 5, "skip_from": 6, "skip_to": 12},
        },
    )
    replay(engine, range(2), range(6, 16), lambda n: n + 7)
    evaluated(engine, T0 + 81)
    assert drift_events(engine) == []
    # Attempt 2 resumes from the checkpoint of step 12: with the sampler's position
    # restored (batches 20-22 again), or with a sampler back at its seed.
    new_attempt(engine, at=T0 + 100)
    batch_of = (lambda n: n + 7) if restored else (lambda n: n - 13)
    replay(engine, range(2), range(13, 16), batch_of, at=T0 + 110)
    evaluated(engine, T0 + 131)
    assert [(s, r, f) for s, r, f, _ in drift_events(engine)] == (
        [] if restored else [(13, [0, 1], {"0": 0, "1": 0})]
    )


def tensor_parallel_run(engine) -> None:
    """4 ranks, 2-way tensor parallel x 2-way data parallel (replica groups 0,2 and 1,3)."""
    for rank in range(4):
        group = "0,2" if rank % 2 == 0 else "1,3"
        steps = [
            sampled(n, own(rank // 2, n), ts=T0 + n, fingerprint="0" * 32, replica_group=group)
            for n in range(10)
        ]
        send(engine, rank, steps, T0 + 20, world=4)
    new_attempt(engine, world=4, number=1, at=T0)


def resumed_with_groups(engine, world: int, group: str, batch_of: Any) -> None:
    """Attempt 2 on ``world`` ranks of replica group ``group`` replays steps 6-9."""
    new_attempt(engine, world=world)
    for rank in range(world):
        steps = [
            sampled(
                n, own(rank, batch_of(n)), ts=T0 + 60 + n, fingerprint="0" * 32, replica_group=group
            )
            for n in range(6, 10)
        ]
        send(engine, rank, steps, T0 + 80, world=world)
    evaluated(engine, T0 + 81)


def test_the_data_parallel_size_not_the_world_size_declares_a_re_shard(engine) -> None:
    tensor_parallel_run(engine)
    # Attempt 2 drops tensor parallelism: 2 ranks, still 2 replicas (one group 0,1). The
    # world size changed, the data-parallel size did not: each replica's data must match.
    resumed_with_groups(engine, 2, "0,1", lambda n: n - 6)
    assert [(s, r) for s, r, _, _ in drift_events(engine)] == [(6, [0, 1])]


def test_a_new_data_parallel_size_under_one_world_size_is_a_re_shard(engine) -> None:
    tensor_parallel_run(engine)
    resumed_with_groups(engine, 4, "0-3", lambda n: 2 * n)  # no tensor parallel: 4 replicas
    assert drift_events(engine) == []


# -- re-fed within the epoch -----------------------------------------------------------------


def epoch_step(rank: int, n: int, position: int, digest_step: int, ts: float) -> dict[str, Any]:
    """Step ``n`` of epoch ``n // 5`` training the batch at ``position`` of the epoch (the
    same 4 ids every epoch, ``(position * 2 + rank) * 4`` on), its digest ``digest_step``'s."""
    ids = [(position * 2 + rank) * 4 + k for k in range(4)]
    s = sampled(n, own(rank, digest_step), ts=ts)
    s.update(samples_count=4, samples_epoch=n // 5, samples_kept=ids)
    return s


def two_epochs_then(engine, batch_of: Any) -> None:
    """Epochs 0 (steps 0-4) and 1 (5-9) of 2 ranks; attempt 2 resumes from step 6 and runs
    7-9 on ``batch_of(n)``: (position, digest step)."""
    for rank in range(2):
        steps = [epoch_step(rank, n, n % 5, n, T0 + n) for n in range(10)]
        send(engine, rank, steps, T0 + 20, world=2)
    new_attempt(engine, world=2, number=1, at=T0)
    new_attempt(engine)
    for rank in range(2):
        steps = [epoch_step(rank, n, *batch_of(n), T0 + 60 + n) for n in range(7, 10)]
        send(engine, rank, steps, T0 + 80, world=2)


def test_a_batch_of_an_earlier_epoch_is_not_re_fed_in_this_one(engine) -> None:
    # Step 7 (epoch 1) trains the batch epoch 0 trained at step 3, which epoch 1 had not
    # reached: skipped ahead in this epoch, not re-fed.
    two_epochs_then(engine, lambda n: (n - 4, n - 4))
    evaluated(engine, T0 + 81)
    ((step, ranks, refed, reason),) = drift_events(engine)
    assert (step, ranks, refed) == (7, [0, 1], {})
    assert "out of order (batches not trained on before at earlier steps of epoch 1" in reason
    e = m.events.c
    with engine.connect() as conn:
        data = conn.execute(select(e.data).where(e.kind == "data_order_drift")).scalar_one()
    assert (data["epoch"], data["refed_samples"], data["samples"]) == (
        1,
        {"0": 0, "1": 0},
        {"0": 4, "1": 4},
    )


def test_a_sampler_back_at_the_epoch_s_start_re_feeds_and_its_end_names_the_skipped(
    engine,
) -> None:
    from .coverage_scenario import epoch_end

    # The sampler restarts epoch 1: steps 7-9 train its positions 0-2 again (step 5's,
    # 6's batches, then position 2's): re-fed from step 5; positions 3 and 4 are skipped.
    two_epochs_then(engine, lambda n: (n - 7, n - 2))
    evaluated(engine, T0 + 81)
    ((step, ranks, refed, _),) = drift_events(engine)
    assert (step, ranks, refed) == (7, [0, 1], {"0": 5, "1": 5})
    e = m.events.c
    with engine.connect() as conn:
        data = conn.execute(select(e.data).where(e.kind == "data_order_drift")).scalar_one()
    assert data["refed_samples"] == {"0": 4, "1": 4}
    for rank in range(2):
        end = epoch_end(1, 9, 40)
        end["ts"] = T0 + 82
        with write_engine(engine) as conn:
            body = batch(rank=rank, world_size=2, steps=[], events=[end])
            ingest(conn, batch=IngestBatch.model_validate(body), now=T0 + 82)
    evaluated(engine, T0 + 90)
    with engine.connect() as conn:
        cover = conn.execute(select(e.data).where(e.kind == "epoch_coverage")).scalar_one()
    # Epoch 1 as last executed: positions 0, 1 (steps 5, 6), 0, 1, 2 (steps 7-9).
    assert (cover["duplicated"], cover["missing"]) == (16, 16)
    assert cover["order_drift"] == [{"step": 7, "attempt": 2}]
    assert (
        "the data left its path at step 7 (data_order_drift): the samples never seen"
        in (cover["reason"])
    )


def test_the_data_events_fire_their_alerts_and_are_in_the_post_mortem(engine) -> None:
    from trainwarden.alerts import load_rule_packs
    from trainwarden.collector.alerting.engine import AlertEngine
    from trainwarden.collector.incidents.grouping import group
    from trainwarden.collector.incidents.postmortem import report_of
    from trainwarden.collector.incidents.report_format import render_markdown

    first_run(engine)
    new_attempt(engine)
    # The resumed attempt restarts the sampler, and from its seed both ranks draw rank 0's
    # batches: re-fed at step 6, and one batch on both ranks.
    for rank in range(2):
        steps = [sampled(n, own(0, n - 6), ts=T0 + 60 + n) for n in range(6, 10)]
        send(engine, rank, steps, T0 + 80, world=2)
    evaluated(engine, T0 + 81)
    ((_, _, _, drifted),) = drift_events(engine)
    ((_, _, _, duplicated),) = dup_events(engine)
    rules = ("DataOrderDrift", "DuplicateBatchAcrossRanks")
    alerts = AlertEngine(
        engine,
        [r for r in load_rule_packs() if r.name in rules],
        external_url="https://tw.example.org",
        submit=lambda _: None,
    )
    alerts.run_once(now=T0 + 82)
    with engine.connect() as conn:
        fired = conn.execute(select(m.alerts.c.rule, m.alerts.c.state)).all()
    assert sorted(fired) == [("DataOrderDrift", "firing"), ("DuplicateBatchAcrossRanks", "firing")]
    with write_engine(engine) as conn:
        (incident,) = group(conn, now=T0 + 83, cooldown_s=60.0).opened
    with engine.connect() as conn:
        report = report_of(conn, run="r1", now=T0 + 84)
    (told,) = report["incidents"]
    assert told["incident"]["id"] == incident
    said = [e["text"] for e in told["entries"]]
    assert f"data left its path: {drifted}" in said
    assert f"same batch on several ranks: {duplicated}" in said
    page = render_markdown(report)
    assert drifted in page and duplicated in page
