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

import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from trainwarden.agent.replica import compact, expand
from trainwarden.collector.ingest.samples import unpack
from trainwarden.collector.store import models as m
from trainwarden.collector.store.action_plans import RollbackPlan

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
    difference (:func:`_exempt`, :func:`_resized`).

    One event per **episode**: an attempt, or a rollback's replay within it (from its
    commit to the next rollback's or the next attempt's start). Its first step is the
    first drifted step seen; once the event is written, later passes leave the episode
    alone (its first step's rows may have aged out of :data:`WINDOW_S` while the replay
    goes on). A replayed batch that a rank already trained on at an earlier step of the
    same epoch is called **re-fed** (naming that step), any other one **out of order**;
    with kept ids (a dataset size), the event also counts, per rank, the replayed step's
    ids that earlier steps of its epoch had trained on."""
    d = m.sample_digests.c
    rows = conn.execute(
        select(d.step, d.rank, d.digest, d.ts, d.recv_ts).where(
            d.run_id == run_id, d.recv_ts >= now - WINDOW_S, d.digest != d.first_digest
        )
    ).all()
    if not rows:
        return []
    tries = _attempts(conn, run_id)
    episodes = _episodes(tries, _rollbacks(conn, run_id))
    left: dict[Episode, list[Any]] = defaultdict(list)
    resized: dict[int, bool] = {}
    for r in rows:
        episode = _episode_of(episodes, r.ts)
        if _exempt(episode, r.step):
            continue
        if episode.attempt not in resized:
            resized[episode.attempt] = _resized(conn, run_id, tries, episode.attempt)
        if not resized[episode.attempt]:
            left[episode].append(r)
    uids = {episode: f"drift:{run_id}:{episode.key}" for episode in left}
    named = _named(conn, list(uids.values()))
    out = []
    for episode, drifted in left.items():
        if uids[episode] not in named:
            found = _drift_event(conn, run_id, world, now, ended, episode, drifted)
            if found is not None:
                out.append({**found, "uid": uids[episode]})
    return out


def _drift_event(
    conn: Connection,
    run_id: int,
    world: int,
    now: float,
    ended: bool,
    episode: Episode,
    left: list[Any],
) -> dict[str, Any] | None:
    d = m.sample_digests.c
    first = min(r.step for r in left)
    at_first = [r for r in left if r.step == first]
    since = min(r.ts for r in at_first)
    present = set(
        conn.execute(
            select(d.rank).where(d.run_id == run_id, d.step == first, d.ts >= since)
        ).scalars()
    )
    waited = now - min(r.recv_ts for r in at_first)
    if not ended and len(present) < world and waited < GRACE_S:
        return None  # the step's other ranks may still be on their way
    ranks = sorted({r.rank for r in at_first})
    replayed = {
        rank: (epoch, kept)
        for rank, epoch, kept in conn.execute(
            select(d.rank, d.epoch, d.kept).where(
                d.run_id == run_id, d.step == first, d.rank.in_(ranks)
            )
        )
    }
    epochs = {e for e, _ in replayed.values() if e is not None}
    epoch = min(epochs) if len(epochs) == 1 else None
    refed = _refed(conn, run_id, first, {r.rank: r.digest for r in at_first}, epoch)
    ids = _refed_ids(conn, run_id, first, epoch, replayed)
    named = compact(ranks)
    in_epoch = f" of epoch {epoch}" if epoch is not None else ""
    if refed:
        how = (
            f"re-fed (batches they had trained on at earlier steps{in_epoch}: "
            + ", ".join(f"rank {k} the batch of step {v}" for k, v in sorted(refed.items())[:8])
            + ")"
        )
    elif any(ids.values()):
        how = (
            f"re-fed ({sum(ids.values())} of their {sum(_counts(replayed)[k] for k in ids)} "
            f"samples had been trained on at earlier steps{in_epoch})"
        )
    else:
        how = (
            "out of order (batches not trained on before at earlier steps"
            f"{in_epoch}: skipped ahead, or new)"
        )
    data: dict[str, Any] = {
        "ranks": ranks,
        "first_step": first,
        "refed": {str(k): v for k, v in refed.items()},
        "attempt": episode.attempt,
        "episode": episode.what,
        "epoch": epoch,
        "reason": f"step {first} ran again on ranks {named} with other samples than "
        f"its first execution: {how}; the data left its path at step {first}",
    }
    if ids:
        counts = _counts(replayed)
        data["refed_samples"] = {str(k): v for k, v in sorted(ids.items())}
        data["samples"] = {str(k): counts[k] for k in sorted(ids)}
    return {
        "rank": None,
        "kind": "data_order_drift",
        "severity": "warning",
        "step": first,
        "data": data,
    }


def _counts(replayed: dict[int, tuple[int | None, bytes | None]]) -> dict[int, int]:
    return {rank: len(kept) // 8 for rank, (_, kept) in replayed.items() if kept is not None}


def _refed_ids(
    conn: Connection,
    run_id: int,
    step: int,
    epoch: int | None,
    replayed: dict[int, tuple[int | None, bytes | None]],
) -> dict[int, int]:
    """For each rank whose replay of ``step`` kept its ids, how many of them earlier steps
    of ``epoch`` (any rank, as each step's last execution) had trained on."""
    if epoch is None or not any(kept is not None for _, kept in replayed.values()):
        return {}
    d = m.sample_digests.c
    earlier: set[int] = set()
    for (kept,) in conn.execute(
        select(d.kept).where(
            d.run_id == run_id, d.epoch == epoch, d.step < step, d.kept.is_not(None)
        )
    ):
        earlier.update(unpack(kept))
    return {
        rank: sum(1 for i in unpack(kept) if i in earlier)
        for rank, (e, kept) in replayed.items()
        if kept is not None and e == epoch
    }


@dataclass(frozen=True)
class Episode:
    """An attempt, or a rollback's replay within it: executions of steps that ran before
    are compared with their first executions, one drift event an episode."""

    start: float
    attempt: int
    key: str  # the event's uid: drift:{run}:{key}
    what: str  # "attempt 2", "rollback 7 of attempt 1"
    checkpoint: int | None = None  # a skipping rollback's: it restored this step ...
    barrier: int | None = None  # ... after this one (replays ckpt+1..barrier), if known


def _episodes(
    tries: list[tuple[int, float, int | None]], rollbacks: list[Rollback]
) -> list[Episode]:
    out = [Episode(float("-inf"), 0, "0", "the run")]
    out += [Episode(at, n, str(n), f"attempt {n}") for n, at, _ in tries]
    for r in rollbacks:
        attempt = _attempt_of(tries, r.committed_at)
        out.append(
            Episode(
                r.committed_at,
                attempt,
                f"{attempt}:rollback:{r.action}",
                f"rollback {r.action} of attempt {attempt}",
                r.checkpoint if r.skipped else None,
                r.barrier,
            )
        )
    return sorted(out, key=lambda e: e.start)


def _episode_of(episodes: list[Episode], ts: float) -> Episode:
    return [e for e in episodes if e.start <= ts][-1]


def _exempt(episode: Episode, step: int) -> bool:
    """Whether a skipping rollback's replay declared the step's difference: a step after
    its checkpoint, up to the step it was restored after, within its episode (a later
    attempt, or a later rollback, must replay its steps as they last ran)."""
    if episode.checkpoint is None:
        return False
    return step > episode.checkpoint and (episode.barrier is None or step <= episode.barrier)


def _named(conn: Connection, uids: list[str]) -> set[str]:
    """The drift uids of episodes already named (an event stored under each)."""
    if not uids:
        return set()
    hashed = {uuid.uuid5(uuid.NAMESPACE_OID, u).hex: u for u in uids}
    e = m.events.c
    return {hashed[h] for h in conn.execute(select(e.uid).where(e.uid.in_(list(hashed)))).scalars()}


@dataclass(frozen=True)
class Rollback:
    action: int
    checkpoint: int
    committed_at: float
    skipped: int  # batches skipped on purpose (0: a rollback that keeps its data)
    barrier: int | None


def _rollbacks(conn: Connection, run_id: int) -> list[Rollback]:
    """The run's committed rollbacks, each with what it skipped on purpose (a non-empty
    skip window; an SDC rollback keeps its data: its replays must match)."""
    a = m.actions.c
    out = []
    for action, plan in conn.execute(
        select(a.id, a.plan).where(
            a.run_id == run_id, a.kind == "rollback", a.state.in_(("executing", "done"))
        )
    ):
        stored = RollbackPlan.of(plan)
        restore = stored.rollback
        if stored.committed_at is None or restore is None:
            continue
        skipped = 0 if stored.keep_data else max(0, restore.skip_to - restore.skip_from + 1)
        out.append(
            Rollback(
                int(action),
                restore.checkpoint_step,
                stored.committed_at,
                skipped,
                stored.barrier_step,
            )
        )
    return out


def skipping_rollbacks(conn: Connection, run_id: int) -> list[tuple[int, float, int]]:
    """(checkpoint step, when committed, batches skipped) of the run's rollbacks that
    skipped data on purpose (a non-empty skip window; SDC rollbacks keep their data)."""
    return [
        (r.checkpoint, r.committed_at, r.skipped) for r in _rollbacks(conn, run_id) if r.skipped
    ]


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


def _resized(
    conn: Connection, run_id: int, tries: list[tuple[int, float, int | None]], number: int
) -> bool:
    """Whether attempt ``number`` declared a data-parallel size change: its data-parallel
    size differs from the attempt before it's. The data-parallel size is the size of the
    replica group the attempt's ranks sent with their replica checks (tensor- or
    pipeline-parallel peers are in other groups) when both attempts sent one; else the
    attempts' world sizes."""
    starts = {n: at for n, at, _ in tries}
    sizes = {n: size for n, _, size in tries}
    if number - 1 not in starts or number not in starts:
        return False
    ends = {n: starts.get(n + 1, float("inf")) for n in starts}
    before, now = (_data_parallel(conn, run_id, starts[n], ends[n]) for n in (number - 1, number))
    if before is not None and now is not None:
        return before != now
    old, new = sizes.get(number - 1), sizes.get(number)
    return old is not None and new is not None and old != new


def _data_parallel(conn: Connection, run_id: int, start: float, end: float) -> int | None:
    """The size of the replica group of the first replica check of a step that started in
    ``[start, end)``, if one arrived (read from the arrival index: checks arrive after
    their steps start)."""
    c = m.replica_checks.c
    group = conn.execute(
        select(c.replica_group)
        .where(c.run_id == run_id, c.recv_ts >= start, c.ts >= start, c.ts < end)
        .order_by(c.recv_ts)
        .limit(1)
    ).scalar()
    if not group:
        return None
    try:
        return len(expand(group))
    except ValueError:
        return None


def _refed(
    conn: Connection, run_id: int, step: int, digests: dict[int, str], epoch: int | None
) -> dict[int, int]:
    """For each rank, the earlier step (of ``epoch``, when the replay has one) whose first
    batch its replay of ``step`` is."""
    d = m.sample_digests.c
    found: dict[int, int] = {}
    query = select(d.rank, d.step, d.first_digest).where(
        d.run_id == run_id,
        d.rank.in_(list(digests)),
        d.step < step,
        d.first_digest.in_(list(set(digests.values()))),
    )
    if epoch is not None:
        query = query.where(d.epoch == epoch)
    for rank, earlier, digest in conn.execute(query.order_by(d.step)):
        if rank not in found and digest == digests[rank]:
            found[rank] = int(earlier)
    return found
