"""The same batch on several ranks: found from the ranks' sample digests.

In data parallelism every rank of a data-parallel group trains on its own samples; a
seeding bug can give every rank the same batch, and the loss still looks fine (the
effective batch is N times smaller). On a step where the trainer called
``s.samples(ids)``, each rank sends an order-sensitive digest of its ids
(``sample_digests``); ranks of one data-parallel group with the digest of one step
trained on the same batch, in the same order.

The data-parallel groups are the replica groups the ranks sent with their newest replica
check (the ranks that hold the same parameters are the ones that must see different
data; tensor-parallel peers, which share a batch, are in different groups); a run with
no replica check is taken as one group of all its ranks.

A step is compared once every member of a group sent its digest (or :data:`GRACE_S`
after the first did). Each set of ranks found sharing batches gets one
``duplicate_batch`` event, naming them and the first step seen (the event's ``uid``
keeps it one for as long as they go on).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Connection, func, select

from trainwarden.agent.replica import compact, expand
from trainwarden.collector.store import models as m

WINDOW_S = 60.0
"""Each evaluation reads the digests that arrived this recently (an index range)."""
GRACE_S = 10.0
"""A step is compared once every member of the group sent its digest, or this long after
the first did (a rank that sent none is left out)."""


def duplicates(conn: Connection, *, run_id: int, world: int, now: float) -> list[dict[str, Any]]:
    """The ``duplicate_batch`` events of the run's recent steps."""
    d = m.sample_digests.c
    rows = conn.execute(
        select(d.step, d.rank, d.digest, d.recv_ts).where(
            d.run_id == run_id, d.recv_ts >= now - WINDOW_S
        )
    ).all()
    if not rows:
        return []
    group_of = _groups(conn, run_id, world)
    seen: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)  # (group, step): digests
    arrived: dict[tuple[str, int], float] = {}
    for step, rank, digest, recv in rows:
        key = (group_of.get(rank, ""), step)
        seen[key][rank] = digest
        arrived[key] = min(arrived.get(key, recv), recv)
    first: dict[tuple[int, ...], tuple[int, str]] = {}  # ranks -> (first step, its group)
    for (group, step), digests in sorted(seen.items(), key=lambda kv: kv[0][1]):
        members = _members(group, world)
        if not (members <= set(digests) or now - arrived[(group, step)] >= GRACE_S):
            continue  # decided once the whole group's digests of the step are in
        by_digest: dict[str, list[int]] = defaultdict(list)
        for rank, digest in digests.items():
            by_digest[digest].append(rank)
        for ranks in by_digest.values():
            if len(ranks) > 1:
                first.setdefault(tuple(sorted(ranks)), (step, group))
    return [_event(run_id, ranks, step, group) for ranks, (step, group) in first.items()]


def _members(group: str, world: int) -> set[int]:
    try:
        return {r for r in expand(group) if r < world} if group else set()
    except ValueError:
        return set()


def _groups(conn: Connection, run_id: int, world: int) -> dict[int, str]:
    """Each rank's data-parallel group: its newest replica check's, else the world."""
    c = m.replica_checks.c
    newest = (
        select(c.rank, func.max(c.step).label("step")).where(c.run_id == run_id).group_by(c.rank)
    ).subquery()
    found = {
        rank: group
        for rank, group in conn.execute(
            select(c.rank, c.replica_group).join(
                newest,
                (c.rank == newest.c.rank) & (c.step == newest.c.step) & (c.run_id == run_id),
            )
        )
    }
    everyone = compact(range(world)) if world > 0 else ""
    return {rank: found.get(rank, everyone) for rank in range(world)} | found


def _event(run_id: int, ranks: tuple[int, ...], step: int, group: str) -> dict[str, Any]:
    named = compact(ranks)
    try:
        size = len(expand(group)) if group else None
    except ValueError:
        size = None
    of = f" of data-parallel group {group}" if group else ""
    return {
        "rank": None,
        "kind": "duplicate_batch",
        "severity": "warning",
        "step": step,
        "uid": f"dupbatch:{run_id}:{named}:{group}",
        "data": {
            "ranks": list(ranks),
            "replica_group": group or None,
            "group_size": size,
            "first_step": step,
            "reason": f"ranks {named}{of} trained on the same batch (equal sample digests) "
            f"at step {step}: the effective batch is smaller than it should be",
        },
    }
