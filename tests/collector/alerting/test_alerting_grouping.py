"""Grouped pages (``alerts/grouping.py``) from the alert engine on a real database
(SQLite and PostgreSQL): a job or a node that dies whole is one page, not one a rank;
a few ranks page one by one; a group's page is updated and resolved as a group."""

from __future__ import annotations

from sqlalchemy import insert, select

from trainwarden.collector.store import models as m
from trainwarden.collector.store.db import write

from ..helpers import step
from .alerting_helpers import T0, Engine, send


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
