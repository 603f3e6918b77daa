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


def ended_runs(conn: Connection, *, now: float) -> list[tuple[int, int]]:
    """Runs no longer running whose digests arrived within :data:`WINDOW_S`, (id, world
    size): a short run, or a resumed attempt's last steps, can end before an evaluation
    (which reads running runs) saw them."""
    d, ru = m.sample_digests.c, m.runs.c
    return [
        (run_id, world)
        for run_id, world in conn.execute(
            select(ru.id, ru.world_size).where(
                ru.status != "running",
                select(d.run_id).where(d.run_id == ru.id, d.recv_ts >= now - WINDOW_S).exists(),
            )
        )
    ]


def duplicates(
    conn: Connection, *, run_id: int, world: int, now: float, ended: bool = False
) -> list[dict[str, Any]]:
    """The ``duplicate_batch`` events of the run's recent steps. ``ended``: the run is
    over, no digest is still to come: every step is due."""
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
        if not (ended or members <= set(digests) or now - arrived[(group, step)] >= GRACE_S):
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


def drift(
    conn: Connection, *, run_id: int, world: int, now: float, ended: bool = False
) -> list[dict[str, Any]]:
    """``data_order_drift`` events: a step run again (after a restart, or a rollback's
    replay) whose digest differs from its first execution's, where nothing declared a
    difference: not after a rollback that skipped data (its replayed steps train on
    later batches on purpose), not in an attempt whose world size differs from the one
    before it (a declared data-parallel size change: each rank's share of the data
    changes). Named once per first step and attempt, with the ranks that left the path;
    a replayed batch that a rank already trained on at an earlier step is called
    **re-fed** (naming that step), any other one **out of order**."""
    d = m.sample_digests.c
    rows = conn.execute(
        select(d.step, d.rank, d.digest, d.ts, d.recv_ts).where(
            d.run_id == run_id, d.recv_ts >= now - WINDOW_S, d.digest != d.first_digest
        )
    ).all()
    if not rows:
        return []
    skipped = skipping_rollbacks(conn, run_id)
    tries = _attempts(conn, run_id)
    left = [
        r
        for r in rows
        if not any(r.step > ckpt and r.ts >= at for ckpt, at, _ in skipped)
        and not _resized(tries, r.ts)
    ]
    if not left:
        return []
    first = min(r.step for r in left)
    at_first = [r for r in left if r.step == first]
    present = set(
        conn.execute(
            select(d.rank).where(
                d.run_id == run_id, d.step == first, d.ts >= min(r.ts for r in at_first)
            )
        ).scalars()
    )
    waited = now - min(r.recv_ts for r in at_first)
    if not ended and len(present) < world and waited < GRACE_S:
        return []  # the step's other ranks may still be on their way
    ranks = sorted({r.rank for r in at_first})
    refed = _refed(conn, run_id, first, {r.rank: r.digest for r in at_first})
    attempt = _attempt_of(tries, min(r.ts for r in at_first))
    named = compact(ranks)
    how = (
        "re-fed (batches they had trained on at earlier steps: "
        + ", ".join(f"rank {k} the batch of step {v}" for k, v in sorted(refed.items())[:8])
        + ")"
        if refed
        else "out of order (batches not trained on before at earlier steps: skipped ahead, or new)"
    )
    return [
        {
            "rank": None,
            "kind": "data_order_drift",
            "severity": "warning",
            "step": first,
            "uid": f"drift:{run_id}:{first}:{attempt}",
            "data": {
                "ranks": ranks,
                "first_step": first,
                "refed": {str(k): v for k, v in refed.items()},
                "attempt": attempt,
                "reason": f"step {first} ran again on ranks {named} with other samples than "
                f"its first execution: {how}; the data left its path at step {first}",
            },
        }
    ]


def skipping_rollbacks(conn: Connection, run_id: int) -> list[tuple[int, float, int]]:
    """(checkpoint step, when committed, batches skipped) of the run's rollbacks that
    skipped data on purpose (a non-empty skip window; SDC rollbacks keep their data)."""
    a = m.actions.c
    out = []
    for plan in conn.execute(
        select(a.plan).where(
            a.run_id == run_id, a.kind == "rollback", a.state.in_(("executing", "done"))
        )
    ).scalars():
        plan = plan or {}
        restore = plan.get("rollback") or {}
        if plan.get("committed_at") is None or plan.get("keep_data"):
            continue
        try:
            at, low, high = (int(restore[k]) for k in ("checkpoint_step", "skip_from", "skip_to"))
        except (KeyError, TypeError, ValueError):
            continue
        if high >= low:
            out.append((at, float(plan["committed_at"]), high - low + 1))
    return out


def _attempts(conn: Connection, run_id: int) -> list[tuple[int, float, int | None]]:
    t = m.attempts.c
    return [
        (n, at, size)
        for n, at, size in conn.execute(
            select(t.number, t.started_at, t.world_size)
            .where(t.run_id == run_id)
            .order_by(t.number)
        )
    ]


def _attempt_of(tries: list[tuple[int, float, int | None]], ts: float) -> int:
    found = [n for n, at, _ in tries if at <= ts]
    return found[-1] if found else 0


def _resized(tries: list[tuple[int, float, int | None]], ts: float) -> bool:
    """Whether the attempt that ran at ``ts`` has another world size than the one before."""
    number = _attempt_of(tries, ts)
    sizes = {n: size for n, _, size in tries}
    before = sizes.get(number - 1)
    return before is not None and sizes.get(number) is not None and sizes[number] != before


def _refed(conn: Connection, run_id: int, step: int, digests: dict[int, str]) -> dict[int, int]:
    """For each rank, the earlier step whose first batch its replay of ``step`` is."""
    d = m.sample_digests.c
    found: dict[int, int] = {}
    for rank, earlier, digest in conn.execute(
        select(d.rank, d.step, d.first_digest)
        .where(
            d.run_id == run_id,
            d.rank.in_(list(digests)),
            d.step < step,
            d.first_digest.in_(list(set(digests.values()))),
        )
        .order_by(d.step)
    ):
        if rank not in found and digest == digests[rank]:
            found[rank] = int(earlier)
    return found
