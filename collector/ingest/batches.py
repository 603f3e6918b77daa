"""Ingest: store a flush's batches in one transaction, keep run and rank state, and queue
steps for rollup (the batches come as column-wise requests: ``batch_columns``).

Idempotent: a step replayed after a restart (same run, rank and step) overwrites the
earlier row, and an event whose id was seen before is ignored. A rank that comes
back with a new process session is recorded as a ``restart`` event.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter, defaultdict
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    case,
    func,
    or_,
    select,
    update,
)

from trainwarden.collector.ingest import attempts, claims, crashes, endings, replicas, samples
from trainwarden.collector.ingest.batch_columns import (
    Request,
    heads_by_run,
    merged_steps,
    requests_of,
)
from trainwarden.collector.ingest.ranks import (
    known_ranks,
    newest_heads,
    run_id_for,
    track_ranks,
)
from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schemas import (
    IngestBatch,
    IngestResult,
)
from trainwarden.collector.ingest.steps import (
    REPLACED_COLUMNS,
    STEP_ROW,
    days_of,
    queue_rollups,
    step_columns,
    take_rows,
    write_steps,
)
from trainwarden.collector.store import models as m
from trainwarden.collector.store.bulk import dialect_insert, upsert_rows
from trainwarden.collector.store.partitions import day_of, ensure_partitions

# When this process last wrote each run's row: it is shared by every rank, so it is
# touched at most once a second (and always when a rank says goodbye).
_run_touched: weakref.WeakKeyDictionary[Engine, dict[int, float]] = weakref.WeakKeyDictionary()
RUN_TOUCH_S = 1.0


def store_many(
    conn: Connection,
    batches: list[IngestBatch | ColumnarBatch],
    *,
    now: float | None = None,
    arrived: list[float] | None = None,
) -> list[IngestResult]:
    """Store several requests' batches in the caller's transaction, with a fixed number
    of statements per table whatever their number (the collector's group commit).
    ``arrived``: when each request reached the collector (default: ``now``)."""
    now = time.time() if now is None else now
    when = arrived or [now] * len(batches)
    requests, owner = requests_of(batches, when)
    # First, before this transaction locks anything: a day partition a row needs.
    days = {day for req in requests if req.steps for day in days_of(req.steps["ts"])}
    days |= {day_of(g.ts) for req in requests for g in req.gpu}
    ensure_partitions(conn.engine, days)
    run_ids = {}
    for req in sorted(requests, key=lambda r: r.run):
        if req.run not in run_ids:
            run_ids[req.run] = run_id_for(conn, name=req.run, world_size=req.world_size, now=now)

    # Ranks: each run's headers column-wise (a list a field, not an object a rank), their
    # stored rows read once, and the sessions that claim a rank another live process
    # holds refused (claims.py: rare; the requests are then built again without them).
    by_run = heads_by_run(requests, run_ids)
    found = {
        run_id: known_ranks(conn, run_id, list(dict.fromkeys(heads["rank"])))
        for run_id, heads in sorted(by_run.items())
    }
    refused: dict[tuple[int, int], claims.Refusal] = {}
    for run, run_id in run_ids.items():
        if run_id in by_run:
            refused |= claims.check(
                conn,
                run=run,
                run_id=run_id,
                heads=by_run[run_id],
                found=found[run_id],
                batches=batches,
                now=now,
            )
    if refused:
        requests, owner = requests_of(batches, when, refused)
        by_run = heads_by_run(requests, run_ids)
    high_steps: dict[tuple[int, int], int | None] = {}
    for run_id in sorted(by_run):
        heads = by_run[run_id]
        mine = set(heads["rank"])
        known = track_ranks(
            conn,
            run_id=run_id,
            heads=newest_heads(heads),
            now=now,
            found=[row for row in found[run_id] if row[0] in mine],
        )
        high_steps.update({(run_id, rank): high for rank, high in known.items()})

    # Steps, column-wise (no object a row): the same step twice in one flush (a replay
    # inside it, or a rollback's second execution queued behind its first): the later
    # execution wins, and an earlier one is kept as replaced.
    merged: dict[str, list[Any]] = {name: [] for name in STEP_ROW}
    checks: list[dict[str, Any]] = []  # replica fingerprints, on checked steps
    digests: list[dict[str, Any]] = []  # sample digests, on steps that sent ids
    sources: list[dict[str, Any]] = []  # tokens by data source, on steps that sent them
    with_steps: dict[str, list[Request]] = defaultdict(list)
    for req in requests:
        if req.steps:
            with_steps[req.run].append(req)
    for run, group in with_steps.items():  # a run's requests' rows at once
        steps, run_id = merged_steps(group), run_ids[run]
        for name, values in step_columns(run_id, steps, now).items():
            merged[name] += values
        checks += replicas.checks_of(run_id, steps, now)
        digests += samples.digests_of(run_id, steps, now)
        sources += samples.sources_of(run_id, steps)
    keys = list(zip(merged["run_id"], merged["rank"], merged["step"], strict=True))
    if len(set(keys)) < len(keys):
        latest: dict[tuple[int, int, int], int] = {}
        for i, key in enumerate(keys):
            if key not in latest or merged["ts"][i] >= merged["ts"][latest[key]]:
                latest[key] = i
        keep = sorted(latest.values())
        kept = set(keep)
        # Each earlier execution once, however often it was sent (a retried batch).
        earlier = list(
            {
                (keys[i], merged["ts"][i]): i
                for i in range(len(keys))
                if i not in kept and merged["ts"][i] < merged["ts"][latest[keys[i]]]
            }.values()
        )
        if earlier:
            conn.execute(
                dialect_insert(conn, m.replaced_steps).on_conflict_do_nothing(),
                [
                    {**{name: merged[name][i] for name in REPLACED_COLUMNS}, "replaced_at": now}
                    for i in earlier
                ],
            )
        merged = take_rows(merged, keep)
    stored = write_steps(conn, merged, high_steps)
    replicas.write_checks(conn, checks)
    samples.write_digests(conn, digests)
    samples.write_sources(conn, sources)
    queue_rollups(conn, Counter(zip(stored["run_id"], stored["step"], strict=True)), now)

    accepted_events = _store_events(conn, requests, run_ids, now)
    firsts: dict[str, tuple[int, float]] = {}
    done = attempts.sessions_started(conn.engine)
    for req in requests:
        if not done.issuperset(req.heads["session"]):  # a process's first steps: rare
            for rank, session, first in zip(
                req.heads["rank"], req.heads["session"], req.low, strict=True
            ):
                if first is not None and session not in done and session not in firsts:
                    firsts[session] = (first, _started_at(req, rank, first))
    attempts.record_first_steps(conn, firsts)
    _store_gpu(conn, requests, run_ids, now)
    for req in requests:  # a rank saying goodbye ends the run when it is the last
        if any(e.kind == "shutdown" for e in req.events):
            _update_run(
                conn,
                run_id=run_ids[req.run],
                world_size=req.world_size,
                last=None,
                shutdown=True,
                now=now,
            )
    for run, run_id in sorted(run_ids.items()):
        req_last = [max(req.steps["step"]) for req in requests if req.run == run and req.steps]
        world = max((req.world_size for req in requests if req.run == run), default=None)
        if world is None:  # every batch of the run was refused (claims.py): nothing to say
            continue
        _update_run(
            conn,
            run_id=run_id,
            world_size=world,
            last=max(req_last, default=None),
            shutdown=False,
            now=now,
        )
    return _results(batches, requests, owner, accepted_events, refused)


def _results(
    batches: list[IngestBatch | ColumnarBatch],
    requests: list[Request],
    owner: list[int | None],
    accepted_events: list[int],
    refused: dict[tuple[int, int], claims.Refusal],
) -> list[IngestResult]:
    """Each batch's answer: its distinct (rank, step) pairs and its new events, and the
    ranks refused (another process holds them): a rank's batch whole, a node's by rank."""
    totals = [
        [len({s.step for s in b.steps}) if isinstance(b, IngestBatch) else 0, 0] for b in batches
    ]
    for at, _ in refused:  # a rank's batch refused whole stored nothing
        if isinstance(batches[at], IngestBatch):
            totals[at][0] = 0
    for req, i, events in zip(requests, owner, accepted_events, strict=True):
        if i is None:  # agents' steps: counted from their batches above
            continue
        totals[i][1] += events
        if req.steps and not isinstance(batches[i], IngestBatch):  # a node's, and its extras'
            totals[i][0] += len(set(zip(req.steps["rank"], req.steps["step"], strict=True)))
    results = [IngestResult(accepted_steps=n, accepted_events=e) for n, e in totals]
    for (at, rank), refusal in refused.items():
        answer = {"status": refusal.status, **refusal.body}
        if isinstance(batches[at], IngestBatch):
            results[at].refuse(answer)
        else:
            results[at].rank_refused = {**(results[at].rank_refused or {}), rank: answer}
    return results


def _started_at(req: Request, rank: int, step: int) -> float:
    """When ``rank`` started ``step`` in this request (its first step: a rare lookup)."""
    cols = req.steps
    return next(
        ts
        for r, s, ts in zip(cols["rank"], cols["step"], cols["ts"], strict=True)
        if r == rank and s == step
    )


def _store_events(
    conn: Connection, requests: list[Request], run_ids: dict[str, int], now: float
) -> list[int]:
    """Insert every request's events; a replayed event id is ignored and not counted."""
    rows = []
    for req in requests:
        rank = req.agent.rank if req.agent is not None else None
        rows += [
            {
                "uid": e.id,
                "run_id": run_ids[req.run],
                # A dead rank's last words come from a survivor: stored under the dead rank.
                "rank": rank if e.rank is None else e.rank,
                "step": e.step,
                "ts": e.ts,
                "recv_ts": now,
                "kind": e.kind,
                "severity": e.severity,
                "data": e.data,
            }
            for e in req.events
        ]
    if not rows:
        return [0] * len(requests)
    fresh = set(
        conn.execute(
            dialect_insert(conn, m.events)
            .on_conflict_do_nothing(index_elements=["uid"])
            .returning(m.events.c.uid),
            sorted({row["uid"]: row for row in rows}.values(), key=lambda row: str(row["uid"])),
        ).scalars()
    )
    counts = []
    fresh_ids = set(fresh)
    for req in requests:
        counts.append(sum(1 for e in req.events if e.id in fresh))
        fresh -= {e.id for e in req.events}  # the same id twice in one flush counts once
        if req.agent is None:  # a node's columns: steps only
            continue
        run_id, agent = run_ids[req.run], req.agent
        where = (m.ranks.c.run_id == run_id) & (m.ranks.c.rank == agent.rank)
        for e in req.events:
            # A process sends what an earlier process of its rank left in the spool first
            # (killed before it could send it): that one's goodbye is stored as an event,
            # but it does not end this process's attempt nor its rank.
            earlier = agent.started_at is not None and e.ts < agent.started_at
            if earlier and e.kind in ("attempt_end", "shutdown"):
                continue
            if e.kind == "attempt_start" and e.id in fresh_ids:
                attempts.record_start(conn, run_id, agent, e, now)
            elif e.kind == "attempt_end" and e.id in fresh_ids:
                attempts.record_end(conn, agent, e)
                endings.said_end(conn, run_id, agent.rank, e.data.get("reason"))
            elif e.kind == crashes.KIND and e.id in fresh_ids and e.rank is not None:
                crashes.on_ingest(conn, run_id, e.rank, e.data)
            if e.kind == "gpu_telemetry":  # "ok" with the device, or "unavailable" and why
                conn.execute(update(m.ranks).where(where).values(gpu=e.data))
            elif e.kind == "shutdown":  # failed: an exception in a step, or hung in a verdict
                k = m.ranks.c
                before = conn.execute(
                    select(k.state, k.state_detail, k.state_since, k.clock_skew_s).where(where)
                ).first()
                signalled_at = e.data.get("signalled_at")  # the agent's clock: to ours
                if isinstance(signalled_at, int | float) and before is not None:
                    signalled_at = float(signalled_at) + (before.clock_skew_s or 0.0)
                else:
                    signalled_at = None
                state, detail = endings.goodbye(
                    before.state if before else None,
                    before.state_detail if before else None,
                    e.data.get("error"),
                    endings.standing_places(conn, run_id).get(agent.rank),
                    since=before.state_since if before else None,
                    signalled_at=signalled_at,
                )
                conn.execute(
                    update(m.ranks)
                    .where(where)
                    .values(state=state, state_since=now, state_detail=detail)
                )
    return counts


def _store_gpu(
    conn: Connection, requests: list[Request], run_ids: dict[str, int], now: float
) -> None:
    rows = []
    for req in requests:
        if not req.gpu or req.agent is None:
            continue
        run_id, rank = run_ids[req.run], req.agent.rank
        rows += [
            {
                **g.model_dump(),
                "run_id": run_id,
                "rank": rank,
                "day": day_of(g.ts),
                "recv_ts": now,
                "remap_pending": None if g.remap_pending is None else int(g.remap_pending),
                "simulated": int(g.simulated),
            }
            for g in req.gpu
        ]
        latest = max(req.gpu, key=lambda g: g.ts)
        conn.execute(
            update(m.ranks)
            .where(m.ranks.c.run_id == run_id, m.ranks.c.rank == rank)
            .values(
                gpu={
                    "uuid": latest.gpu_uuid,
                    "name": latest.gpu_name,
                    "simulated": latest.simulated,
                }
            )
        )
    if rows:
        rows = list({(r["run_id"], r["rank"], r["ts"]): r for r in rows}.values())
        upsert_rows(conn, m.gpu_samples, rows, key=("run_id", "rank", "ts", "day"))


def _update_run(
    conn: Connection, *, run_id: int, world_size: int, last: int | None, shutdown: bool, now: float
) -> None:
    """Last: this row is shared by every rank of the run, so hold its lock briefly."""
    touched = _run_touched.setdefault(conn.engine, {})
    if not shutdown and now - touched.get(run_id, 0.0) < RUN_TOUCH_S:
        return
    touched[run_id] = now
    values: dict[str, Any] = {"updated_at": now, "world_size": world_size}
    if last is not None:
        r = m.runs.c
        values["last_step"] = case(
            (or_(r.last_step.is_(None), r.last_step < last), last), else_=r.last_step
        )
    if not shutdown:
        conn.execute(update(m.runs).where(m.runs.c.id == run_id).values(status="running", **values))
        return
    # A rank said goodbye: count how the ranks ended (rare, so a scan is fine).
    counts = conn.execute(
        select(
            func.count(),
            func.sum(case((m.ranks.c.state.in_(("finished", "failed")), 1), else_=0)),
        ).where(m.ranks.c.run_id == run_id)
    ).one()
    seen, ended = counts[0], counts[1] or 0
    status = "running"
    if seen >= world_size and ended == seen:  # every rank said goodbye: how it ended
        status = endings.run_outcome(conn, run_id)[0]
    conn.execute(update(m.runs).where(m.runs.c.id == run_id).values(status=status, **values))


def ingest(conn: Connection, *, batch: IngestBatch, now: float | None = None) -> IngestResult:
    """Store one agent's batch in the caller's transaction."""
    return store_many(conn, [batch], now=now)[0]


def ingest_columns(
    conn: Connection, *, batch: ColumnarBatch, now: float | None = None
) -> IngestResult:
    """Store several ranks' steps (a node's, say) in the caller's transaction."""
    return store_many(conn, [batch], now=now)[0]
