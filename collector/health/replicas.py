"""Replicas that disagree: silent data corruption found by comparing fingerprints.

In data parallelism every replica holds bit-identical parameters after each optimizer
step. On a checked step each rank sends a fingerprint of its parameters and the global
ranks of its replica group (``replica_checks``, written by ingest). Each evaluation
compares the steps not yet compared, within each group:

- one fingerprint for all: they **agree**;
- a strict majority: the ranks outside it are **suspects**; no strict majority (a group
  of two that disagrees, a tie): every rank is a suspect, and the next checks decide;
- a member that sent no fingerprint is left out of that comparison (``missing``), not
  called a suspect. A step is compared once every member's fingerprint came, or once
  every missing member has reported a later step (its fingerprint rides on the step's
  record: it will not come), or :data:`GRACE_S` after the first fingerprint came. Ranks
  send on their own schedules: a later check of the group from the ranks ahead is no
  sign that the others' checks of this step are in (deciding on it named a correct rank
  of a disagreeing pair, in CI);
- a rank that went back (a rollback or restart: its last step is before this one) has
  sent the earlier execution's fingerprint: it is not compared with a replay's, but
  waited for (the replay's replaces it, and the step is compared again). So is a rank
  whose check is older than another member's replay of the step, though it has said
  nothing since the rollback (its last step is still the one before it): a member's
  replay replaced its earlier execution (``replaced_steps``), and a check that ran
  before the midpoint of those two executions belongs to the earlier one
  (:func:`_replay_cuts`). After :data:`GRACE_S` without its replay the step is compared
  without it (``missing``).

A probed step (``determinism_probe_every``, agent/probe.py) also carries each rank's
determinism probe: the fingerprint and three sums of the model's output on a fixed
input. The probes of the step's group are compared the same way (:func:`probe_suspects`):
bit-exactly, or, when a rank sent ``probe_rtol``, within that tolerance of the output's
L1 norm. A rank whose probe leaves the majority computes differently from its replicas
(wrong arithmetic), even where its parameters agree.

Each comparison is kept (``replica_results``: what the Ranks page's strip shows), and
each suspect gets a ``replica_divergence`` event naming the step, the group, what
differed (``check``: ``parameters`` or ``probe``) and where it diverged: after the last
check at which its fingerprint (or its probe) agreed with its group's.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, NamedTuple

from sqlalchemy import Connection, and_, exists, func, insert, select

from trainwarden.agent.replica import expand
from trainwarden.collector.store import models as m

GRACE_S = 30.0
"""How long a step's comparison waits for its group's missing fingerprints."""
WINDOW_S = 600.0
"""Checks that arrived longer ago than this and are still not compared are left alone. A
check is due at most :data:`GRACE_S` after it came, so older ones wait only while the
evaluator was down; each evaluation reads this much of a run's checks (an index range),
not the whole run's."""


def ended_runs(conn: Connection, *, now: float) -> list[tuple[int, int]]:
    """Runs no longer running with checks not yet compared, (id, world size): a run's last
    checks often arrive with its end (the evaluator reads running runs only)."""
    c, r, ru = m.replica_checks.c, m.replica_results.c, m.runs.c
    decided = exists().where(
        and_(r.run_id == c.run_id, r.step == c.step, r.replica_group == c.replica_group)
    )
    return [
        (run_id, world)
        for run_id, world in conn.execute(
            select(ru.id, ru.world_size).where(
                ru.status != "running",
                exists().where(c.run_id == ru.id, c.recv_ts >= now - WINDOW_S, ~decided),
            )
        )
    ]


def compare(
    conn: Connection, *, run_id: int, world: int, now: float, ended: bool = False
) -> list[dict[str, Any]]:
    """Compare the run's checked steps that are due; returns the events to store.
    ``ended``: the run is over, so no fingerprint is still to come: every step is due."""
    c, r = m.replica_checks.c, m.replica_results.c
    decided = exists().where(
        and_(r.run_id == c.run_id, r.step == c.step, r.replica_group == c.replica_group)
    )
    # Each rank's last step, read before the checks: a check is stored in the transaction
    # that stores its step, so every check of a rank up to this step is read below.
    k = m.ranks.c
    at: dict[int, int | None] = {
        rank: last
        for rank, last in conn.execute(select(k.rank, k.last_step).where(k.run_id == run_id))
    }
    rows = conn.execute(
        select(
            c.step,
            c.rank,
            c.replica_group,
            c.fingerprint,
            c.recv_ts,
            c.probe,
            c.probe_sums,
            c.probe_rtol,
            c.ts,
        ).where(c.run_id == run_id, c.recv_ts >= now - WINDOW_S, ~decided)
    ).all()
    if not rows:
        return []
    # A step an earlier attempt ran, decided only now: its result is kept, but it names no
    # rank (the job restarted since; the rank may be on another node, and the attempt's
    # own divergences were named while it ran).
    t = m.attempts.c
    restarted_at = conn.execute(select(func.max(t.started_at)).where(t.run_id == run_id)).scalar()
    stale: set[tuple[str, int]] = set()
    cuts = _replay_cuts(conn, run_id, rows)
    replaying: dict[tuple[str, int], set[int]] = defaultdict(set)
    pending: dict[tuple[str, int], dict[int, str]] = defaultdict(dict)
    probes: dict[tuple[str, int], dict[int, Probe]] = defaultdict(dict)
    first_seen: dict[tuple[str, int], float] = {}
    ran_at: dict[tuple[str, int], float] = {}  # when the step ran (its ranks' clocks)
    for step, rank, group, fp, recv, probe, sums, rtol, ts in rows:
        last = at.get(rank)
        if last is not None and last < step:
            # The rank went back (a rollback, a restart) and has not run this step again
            # yet: what it sent is the earlier execution's, not comparable with a replay.
            continue
        if ts < cuts.get(step, ts):
            # An earlier execution than another member's replay: its replay is to come.
            replaying[(group, step)].add(rank)
            continue
        pending[(group, step)][rank] = fp
        first_seen[(group, step)] = min(first_seen.get((group, step), recv), recv)
        if restarted_at is not None and ts < restarted_at:
            stale.add((group, step))
        if probe is not None:
            probes[(group, step)][rank] = Probe(probe, sums, rtol or 0.0)
        ran_at[(group, step)] = max(ran_at.get((group, step), ts), ts)
    events: list[dict[str, Any]] = []
    for (group, step), prints in sorted(pending.items(), key=lambda kv: kv[0][1]):
        members = _members(group, world)
        present = {rank: fp for rank, fp in prints.items() if rank in members}
        missing = sorted(members - set(present))
        waiting = replaying.get((group, step), set())
        due = (
            ended
            or now - first_seen[(group, step)] >= GRACE_S
            or not members
            or not missing
            or all((at.get(rank) or -1) > step and rank not in waiting for rank in missing)
        )  # (a missing rank past the step without a check sends none: not waited for)
        if not due:
            continue
        counts = Counter(present.values())
        majority, agreeing = counts.most_common(1)[0] if counts else (None, 0)
        if len(counts) <= 1:
            suspects: list[int] = []
        elif agreeing * 2 > len(present):
            suspects = sorted(rank for rank, fp in present.items() if fp != majority)
        else:
            majority = None
            suspects = sorted(present)
        probed = {r: p for r, p in probes.get((group, step), {}).items() if r in present}
        odd, probe_agreeing = probe_suspects(probed) if probed else ([], 0)
        conn.execute(
            insert(m.replica_results).values(
                run_id=run_id,
                step=step,
                replica_group=group,
                decided_at=now,
                agree=not suspects,
                suspects=suspects,
                missing=missing if members else sorted(present),
                fingerprints=len(present),
                probe_suspects=odd if probed else None,
                probes=len(probed) if probed else None,
            )
        )
        if (group, step) in stale:
            continue  # kept in replica_results; no event for an earlier attempt's step
        # Each event says when its step ran (``ran_at``, its ranks' clocks): a check that an
        # attempt ran and the collector decided only after the job restarted (its last rows
        # came late) is then known as the ended attempt's, and opens no alert of the new
        # one (alerts/evaluate_events.py, _fresh).
        for rank in suspects:
            since = _last_agreed(conn, run_id=run_id, group=group, rank=rank, before=step)
            event = _divergence(
                run_id, rank, step, group, present, missing, majority, agreeing, since
            )
            event["data"]["ran_at"] = ran_at[(group, step)]
            events.append(event)
        for rank in odd:
            since = _last_agreed(
                conn, run_id=run_id, group=group, rank=rank, before=step, probe=True
            )
            event = _probe_divergence(run_id, rank, step, group, probed, probe_agreeing, since)
            event["data"]["ran_at"] = ran_at[(group, step)]
            events.append(event)
    return events


def _replay_cuts(conn: Connection, run_id: int, rows: Any) -> dict[int, float]:
    """For each step among ``rows`` (the checks to compare) that a member ran again: the
    time before which a check of it belongs to an earlier execution. A replay replaced
    the member's earlier execution (``replaced_steps``: its time) with its current one
    (its check's time); ranks run a step in lockstep, so every rank's earlier execution
    ran near the first and its replay near the second: the midpoint between them
    separates the two, whatever the ranks' clocks differ by less than half the gap (a
    rollback's round trip and the steps it replays, seconds at least)."""
    current = {(step, rank): ts for step, rank, *_, ts in rows}
    steps = sorted({step for step, _ in current})
    p = m.replaced_steps.c
    cuts: dict[int, float] = {}
    for at in range(0, len(steps), 500):
        for step, rank, earlier in conn.execute(
            select(p.step, p.rank, func.max(p.ts))
            .where(p.run_id == run_id, p.step.in_(steps[at : at + 500]))
            .group_by(p.step, p.rank)
        ):
            now_ts = current.get((step, rank))
            if now_ts is not None and now_ts > earlier:
                middle = (earlier + now_ts) / 2
                cuts[step] = max(cuts.get(step, middle), middle)
    return cuts


class Probe(NamedTuple):
    """One rank's determinism probe of one step."""

    bits: str
    sums: list[float] | None
    rtol: float


def probe_suspects(probes: dict[int, Probe]) -> tuple[list[int], int]:
    """The ranks whose probe is out of the group's majority, and how many agree with it.

    Two probes agree when their bits are equal or, with a tolerance (the largest
    ``probe_rtol`` sent), when each of their three sums differs by at most ``rtol`` times
    the larger L1 norm (the second sum). The majority is the agreeing set of the rank that
    agrees with the most others (the lowest such rank); it must be a strict majority,
    else every rank is a suspect (two that disagree: both), as for parameters."""
    ranks = sorted(probes)
    if len(ranks) < 2:
        return [], len(ranks)
    rtol = max(p.rtol for p in probes.values())

    def agree(a: Probe, b: Probe) -> bool:
        if a.bits == b.bits:
            return True
        if not rtol or a.sums is None or b.sums is None:
            return False
        scale = rtol * max(abs(a.sums[1]), abs(b.sums[1]))
        return all(abs(x - y) <= scale for x, y in zip(a.sums, b.sums, strict=True))

    peers = {r: {q for q in ranks if agree(probes[r], probes[q])} for r in ranks}
    best = max(ranks, key=lambda r: (len(peers[r]), -r))
    majority = peers[best]
    if len(majority) == len(ranks):
        return [], len(ranks)
    if len(majority) * 2 > len(ranks):
        return sorted(set(ranks) - majority), len(majority)
    return ranks, 0


def _members(group: str, world: int) -> set[int]:
    """The group's ranks (none when its text is not a group of this run's ranks)."""
    try:
        ranks = set(expand(group))
    except ValueError:
        return set()
    return ranks if ranks and max(ranks) < world else set()


def _last_agreed(
    conn: Connection, *, run_id: int, group: str, rank: int, before: int, probe: bool = False
) -> int | None:
    """The newest earlier compared step of ``group`` at which ``rank``'s fingerprint (its
    probe, with ``probe``) was in the majority."""
    c, r = m.replica_checks.c, m.replica_results.c
    suspects_of = r.probe_suspects if probe else r.suspects
    query = (
        select(r.step, suspects_of)
        .join(
            m.replica_checks,
            and_(c.run_id == r.run_id, c.step == r.step, c.replica_group == r.replica_group),
        )
        .where(r.run_id == run_id, r.replica_group == group, r.step < before, c.rank == rank)
    )
    if probe:
        query = query.where(c.probe.is_not(None), r.probes.is_not(None))
    for step, suspects in conn.execute(query.order_by(r.step.desc()).limit(200)).all():
        if rank not in (suspects or ()):
            return int(step)
    return None


def _divergence(
    run_id: int,
    rank: int,
    step: int,
    group: str,
    present: dict[int, str],
    missing: list[int],
    majority: str | None,
    agreeing: int,
    since: int | None,
) -> dict[str, Any]:
    window = f"in steps {since + 1}-{step}" if since is not None else f"at or before step {step}"
    if majority is None:
        reason = (
            f"the {len(present)} fingerprints of replica group {group} at step {step} have no "
            f"majority: rank {rank} is a suspect until the next checks decide"
        )
    else:
        reason = (
            f"rank {rank}'s parameters differ from its replica group's ({agreeing} of "
            f"{len(present)} ranks of {group} agree) at step {step}"
        )
    reason += (
        f"; it last agreed at step {since}: diverged {window}"
        if since is not None
        else "; no earlier agreeing check"
    )
    return {
        "rank": rank,
        "kind": "replica_divergence",
        "severity": "critical",
        "step": step,
        "uid": f"replica:{run_id}:{group}:{rank}:{step}",
        "data": {
            "check": "parameters",
            "replica_group": group,
            "fingerprint": present[rank],
            "majority": majority,
            "agreeing": agreeing,
            "compared": len(present),
            "missing": missing[:64],
            "last_agreed_step": since,
            # Parameters were verified equal after that step's update: its checkpoint and
            # older ones are clean, exactly (a rollback restores the newest of them).
            "clean_through": since,
            "reason": reason,
        },
    }


def _probe_divergence(
    run_id: int,
    rank: int,
    step: int,
    group: str,
    probes: dict[int, Probe],
    agreeing: int,
    since: int | None,
) -> dict[str, Any]:
    rtol = max(p.rtol for p in probes.values())
    how = f"within probe_rtol {rtol:g}" if rtol else "bit-exactly"
    if agreeing == 0:
        reason = (
            f"the {len(probes)} determinism probes of replica group {group} at step {step} "
            f"have no majority ({how}): rank {rank} is a suspect until the next probes decide"
        )
    else:
        reason = (
            f"rank {rank} computes a different output from its replicas on the same input "
            f"and parameters ({agreeing} of {len(probes)} ranks of {group} agree {how}) at "
            f"step {step}: wrong arithmetic"
        )
    window = f"in steps {since + 1}-{step}" if since is not None else f"at or before step {step}"
    reason += (
        f"; its probe last agreed at step {since}: it went wrong {window}"
        if since is not None
        else "; no earlier agreeing probe"
    )
    mine = probes[rank]
    return {
        "rank": rank,
        "kind": "replica_divergence",
        "severity": "critical",
        "step": step,
        "uid": f"replica-probe:{run_id}:{group}:{rank}:{step}",
        "data": {
            "check": "probe",
            "replica_group": group,
            "probe": mine.bits,
            "probe_sums": mine.sums,
            "probe_rtol": rtol,
            "agreeing": agreeing,
            "compared": len(probes),
            "last_agreed_step": since,
            # Its arithmetic was right when that probe ran, after that step's update: the
            # gradients it gave up to then were too, and so are that step's checkpoint
            # and older ones.
            "clean_through": since,
            "reason": reason,
        },
    }
