"""Epoch coverage and the data mixture (collector/health/coverage.py, mixture.py): an
epoch counted once every rank ended it, from the last execution of each step; exact
counts and examples up to the exact bound, estimates with their error on a sample beyond;
the realized mixture against the declared one; bad input refused naming the field (SQLite
and PostgreSQL)."""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from trainwarden.agent import samples as agent_samples
from trainwarden.collector.app import create_app
from trainwarden.collector.health import coverage
from trainwarden.collector.ingest.batches import ingest
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import batch, step
from .coverage_scenario import T0, epoch_end
from .replica_scenario import evaluated


def ids_step(n: int, ids: list[int], epoch: int, ts: float | None = None) -> dict[str, Any]:
    s = step(n)
    s.update(
        samples_digest=f"{n:016x}", samples_count=len(ids), samples_epoch=epoch, samples_kept=ids
    )
    if ts is not None:
        s["ts"] = ts
    return s


def send(
    engine, rank: int, at: float, steps: list | None = None, events: list | None = None
) -> None:
    body = batch(rank=rank, world_size=4, steps=steps or [], events=events or [])
    with write(engine) as conn:
        ingest(conn, batch=IngestBatch.model_validate(body), now=at)


def found(engine, kind: str) -> list[dict[str, Any]]:
    e = m.events.c
    with engine.connect() as conn:
        rows = conn.execute(select(e.step, e.data).where(e.kind == kind).order_by(e.id)).all()
    return [{**r.data, "at_step": r.step} for r in rows]


def test_an_epoch_is_counted_exactly_once_every_rank_ended_it(engine) -> None:
    """4 ranks, 100 samples, 5 steps of 5 ids a rank. Epoch 0: rank 0 trains on 6 in
    place of 7, rank 2 on 51 in place of 50 (2 repeated, 2 missing: within the
    allowance of world - 1 = 3, info only); rank 3's step 4 first ran on wrong ids and
    was replayed on its own (the replay counts). Epoch 1: rank 1 trains 5 ids twice."""
    for rank in range(4):
        mine = list(range(rank * 25, rank * 25 + 25))
        if rank == 0:
            mine[7] = 6
        if rank == 2:
            mine[0] = 51
        steps = [ids_step(n, mine[n * 5 : n * 5 + 5], 0) for n in range(5)]
        if rank == 3:
            steps[4] = ids_step(4, [0, 1, 2, 3, 4], 0)
        send(engine, rank, T0 + 1, steps, [epoch_end(0, 4, 100)] if rank < 3 else [])
    evaluated(engine, T0 + 2)
    assert found(engine, "epoch_coverage") == []  # rank 3 has not ended the epoch
    replay = ids_step(4, [95, 96, 97, 98, 99], 0, ts=1_700_000_100.0)
    send(engine, 3, T0 + 3, [replay], [epoch_end(0, 4, 100)])
    evaluated(engine, T0 + 4)
    evaluated(engine, T0 + 5)  # said once
    (counted,) = found(engine, "epoch_coverage")
    assert {k: counted[k] for k in ("seen", "distinct", "duplicated", "missing")} == {
        "seen": 100,
        "distinct": 98,
        "duplicated": 2,
        "missing": 2,
    }
    assert counted["exact"] is True and counted["duplicated_error"] == 0.0
    assert counted["missing_examples"] == [7, 50]
    assert counted["duplicate_examples"] == [
        {"id": 51, "at": [[0, 2], [0, 2]]},  # in order of first sight: step 0 of rank 2
        {"id": 6, "at": [[1, 0], [1, 0]]},  # rank 0's step 1 holds 6 twice
    ]
    assert counted["first_duplicate_step"] == 0 and counted["ranks"] == "0-3"
    assert counted["reason"] == "epoch 0: 98 of 100 samples trained on, 2 repeated, 2 never seen"
    assert found(engine, "data_duplicated") == found(engine, "data_skipped") == []

    for rank in range(4):  # epoch 1: rank 1 repeats its first 5 ids at its step 7
        mine = list(range(rank * 25, rank * 25 + 25))
        if rank == 1:
            mine[10:15] = mine[0:5]
        steps = [ids_step(5 + n, mine[n * 5 : n * 5 + 5], 1) for n in range(5)]
        send(engine, rank, T0 + 6, steps, [epoch_end(1, 9, 100)])
    evaluated(engine, T0 + 7)
    (dup,) = found(engine, "data_duplicated")
    (skip,) = found(engine, "data_skipped")
    assert (dup["epoch"], dup["duplicated"], dup["at_step"]) == (1, 5, 7)
    assert dup["reason"] == "epoch 1: 5 samples trained on more than once, the first at step 7"
    assert (skip["missing"], skip["missing_examples"]) == (5, [35, 36, 37, 38, 39])
    assert skip["reason"] == "epoch 1: 5 of 100 samples never trained on"


def test_beyond_the_bound_the_sample_is_counted_and_the_totals_estimated(
    engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dataset of 10,000 with a sample of 1,000 (the agent's bound lowered to 1,000):
    the agent's Universe and the collector's sample are the same ids; 20 of the sample
    dropped and 30 repeated read as 200 +- 44.7 missing and 300 +- 54.8 repeated."""
    monkeypatch.setattr(agent_samples, "EXACT_MAX", 1000)
    universe = agent_samples.Universe(10_000)
    assert (universe.kept, universe.exact) == (1000, False)
    sample = list(coverage.sample_ids(10_000, 1000))
    assert sorted(sample) == universe.keep_flat(list(range(10_000)))  # the same 1,000 ids
    ids = sample[20:] + sample[20:50]  # 20 never seen, 30 twice
    for rank in range(4):
        mine = ids[rank::4]
        steps = [ids_step(n, mine[n * 50 : n * 50 + 50], 0) for n in range(len(mine) // 50 + 1)]
        last = steps[-1]["step"]
        send(engine, rank, T0 + 1, steps, [epoch_end(0, last, 10_000, 1000)])
    evaluated(engine, T0 + 2)
    (counted,) = found(engine, "epoch_coverage")
    assert (counted["missing"], counted["missing_error"]) == (200, round(math.sqrt(20) * 10, 1))
    assert (counted["duplicated"], counted["duplicated_error"]) == (
        300,
        round(math.sqrt(30) * 10, 1),
    )
    assert counted["exact"] is False and counted["missing_examples"] == sample[:10]
    assert "(estimated from 1 in 10 samples)" in counted["reason"]
    assert len(found(engine, "data_duplicated")) == len(found(engine, "data_skipped")) == 1


def test_what_the_loaders_drop_by_design_is_allowed(engine) -> None:
    """4 ranks over 48 samples, each leaving 2 out (drop_last's incomplete batch): 8
    missing, past world - 1 = 3 but within 3 + the 8 declared."""
    for rank in range(4):
        end = epoch_end(0, 0, 48)
        end["data"]["dropped"] = 2
        send(engine, rank, T0 + 1, [ids_step(0, list(range(rank * 12, rank * 12 + 10)), 0)], [end])
    evaluated(engine, T0 + 2)
    (counted,) = found(engine, "epoch_coverage")
    assert (counted["missing"], counted["dropped"], counted["missing_allowance"]) == (8, 8, 11)
    assert found(engine, "data_skipped") == []


def test_an_ended_run_s_last_epoch_is_counted_without_waiting(engine) -> None:
    for rank in range(2):
        send(engine, rank, T0 + 1, [ids_step(0, [rank * 2, rank * 2 + 1], 0)])
    send(engine, 0, T0 + 1, events=[epoch_end(0, 0, 4)])  # rank 1 ended it never
    with write(engine) as conn:
        conn.execute(m.runs.update().values(status="completed"))
    evaluated(engine, T0 + 2)
    (counted,) = found(engine, "epoch_coverage")
    assert (counted["distinct"], counted["missing"], counted["ranks"]) == (4, 0, "0")


def test_the_mixture_realized_against_the_declared(engine) -> None:
    declare = {
        "id": uuid.uuid4().hex,
        "kind": "attempt_start",
        "ts": T0,
        "data": {"attempt": "a1", "data_mixture": {"web": 0.7, "code": 0.3}},
    }
    send(engine, 0, T0, events=[declare])
    for rank in range(2):  # 40 steps: too few to judge
        steps = []
        for n in range(40):
            s = step(n)
            s["data_sources"] = {"web": 500, "code": 500}
            steps.append(s)
        send(engine, rank, T0 + 1, steps)
    evaluated(engine, T0 + 2)
    assert found(engine, "data_mixture_drift") == []
    for rank in range(2):
        steps = []
        for n in range(40, 60):
            s = step(n)
            s["data_sources"] = {"web": 700, "code": 300} if n < 50 else {"code": 1000}
            steps.append(s)
        send(engine, rank, T0 + 3, steps)
    evaluated(engine, T0 + 4)
    drift = {d["source"]: d for d in found(engine, "data_mixture_drift")}
    # tokens: web 40*500*2 + 10*700*2 = 54,000; code 40*500*2 + 10*300*2 + 10*1000*2 = 66,000
    assert drift["web"]["realized"] == {"code": 0.55, "web": 0.45}
    assert drift["web"]["tokens"] == {"code": 66_000, "web": 54_000}
    assert drift["web"]["window"] == [0, 59] and set(drift) == {"web", "code"}
    assert drift["code"]["reason"] == (
        "source code gave 55.0% of the tokens of steps 0-59, declared 30.0% (tolerance 6.0%)"
    )


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda s, e: s.pop("samples_digest"), "samples_kept / samples_epoch: sent without"),
        (lambda s, e: s.update(samples_kept=[1.5]), "samples_kept"),
        (lambda s, e: s.update(samples_kept=[0, 2**63]), "samples_kept: an id outside int64"),
        (lambda s, e: s.update(samples_epoch=-1), "samples_epoch"),
        (lambda s, e: s.update(data_sources={"Web": 1}), "source name 'Web' must match"),
        (lambda s, e: s.update(data_sources={"web": -1}), "data_sources"),
        (lambda s, e: e["data"].update(kept=200), "kept 200 is over dataset_size 100"),
        (lambda s, e: e["data"].pop("last_step"), "data.last_step"),
        (
            lambda s, e: e.update(kind="attempt_start", data={"data_mixture": {"web": 0.5}}),
            "data.data_mixture: Value error, the weights must sum to 1, they sum to 0.5",
        ),
        (
            lambda s, e: e.update(
                kind="attempt_start", data={"data_mixture": {"a": -0.5, "b": 1.5}}
            ),
            "'a': a weight must be >= 0",
        ),
    ],
)
def test_bad_data_fields_are_refused_naming_them_and_nothing_is_stored(
    engine, mutate: Any, where: str
) -> None:
    # Stored before: the same step with other ids and tokens, its epoch's end. A refused
    # request of a later execution of the step (which would replace them) leaves them be.
    seeded = ids_step(0, [7, 8, 9], 0, ts=T0)
    seeded["data_sources"] = {"web": 5}
    send(engine, 0, T0 + 1, [seeded], [epoch_end(0, 0, 100)])
    before = stored(engine)
    s = ids_step(0, [1, 2], 0, ts=T0 + 10)
    s["samples_digest"] = "00000000000000ff"
    s["data_sources"] = {"web": 9}
    e = epoch_end(0, 0, 100)
    mutate(s, e)
    with TestClient(create_app(engine, ui=False, health=None, rollups=False)) as client:
        body = batch(rank=0, world_size=4, steps=[s], events=[e])
        response = client.post("/api/v1/ingest", json=body)
        assert response.status_code == 422, response.text
        assert where in response.text, response.text
        columns = {
            "run": "r1",
            "world_size": 4,
            "agents": [body["agent"]],
            "steps": {"rank": [0], **{k: [v] for k, v in s.items()}},
        }
        if "data" not in where and "kept 200" not in where and "'a'" not in where:
            refused = client.post("/api/v1/ingest/columns", json=columns)  # the relay's form
            assert refused.status_code == 422, refused.text
    assert stored(engine) == before
    assert before["digests"] == [(0, 0, "0000000000000000", 3, 0, [7, 8, 9])]
    assert before["tokens"] == [(0, 0, "web", 5)] and len(before["events"]) == 1


def stored(engine) -> dict[str, list]:
    """What the data tables hold, in order."""
    from trainwarden.collector.ingest.samples import unpack

    d, t, e = m.sample_digests.c, m.source_tokens.c, m.events.c
    with engine.connect() as conn:
        return {
            "digests": [
                (r.step, r.rank, r.digest, r.count, r.epoch, list(unpack(r.kept)))
                for r in conn.execute(select(m.sample_digests).order_by(d.step, d.rank))
            ],
            "tokens": [
                (r.step, r.rank, r.source, r.tokens)
                for r in conn.execute(select(m.source_tokens).order_by(t.step, t.source))
            ],
            "events": [
                (r.kind, r.step, r.data) for r in conn.execute(select(m.events).order_by(e.id))
            ],
        }
