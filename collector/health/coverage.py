"""Epoch coverage: which samples an epoch trained on, how many twice, how many never.

With a dataset size (``tw.init(dataset_size=N)``, or a watched loader's dataset length)
each rank sends, on a step where it gave its sample ids, the step's epoch and the ids of
the dataset's coverage sample (agent/samples.py: all of them up to 1,048,576 samples,
else a fixed sample of that many), and an ``epoch_end`` event after an epoch's last
step. Once every rank of the run ended epoch e (or :data:`WAIT_ALL_S` after the first
did; at once when the run is over), the epoch is counted from the rows that hold its
steps: a step run again (a restart's replay, a rollback's) counts as its last execution,
the one the model kept.

- **exact** (``N`` up to 1,048,576): ``seen`` ids, ``distinct``, ``duplicated`` (the
  extra occurrences: ``seen - distinct``), ``missing`` (``N - distinct``),
  ``out_of_range`` (ids outside ``[0, N)``), with examples: the first repeated ids and
  the steps and ranks that trained on them, the first missing ids.
- **sampled** (larger ``N``): the same counts taken exactly on the sample, each repeated
  or missing id named is one; the epoch's totals are the sample's scaled by ``N / kept``
  (unbiased), with ``*_error`` the standard error of the scaling (``sqrt(x) * N / kept``).

Each judged epoch is an ``epoch_coverage`` event (info); more repeats than the
allowance is also ``data_duplicated``, more missing ``data_skipped`` (warnings). The
allowance: ``world - 1`` samples (what a distributed sampler pads or drops to give every
rank the same count) plus :data:`TOLERANCE` of the dataset; for missing samples also what
the loaders declared they drop (``drop_last``'s incomplete batch: ``dropped`` in their
``epoch_end``) and the batches a rollback restored into the epoch skipped on purpose (its
skip window, at the epoch's samples a step). A sampled count is past it only when its
estimate less two standard errors is.

Where a resume or a replay left the data's path at a step of the epoch (a
``data_order_drift`` event), the event lists it (``order_drift``): the epoch's missing
samples then include the ones it skipped (never seen by the epoch's end), its repeats the
ones it re-fed. This is where the skipped samples are classified: the drift event is
written before the epoch ends, and a replay replaces its step's ids.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

from sqlalchemy import Connection, select

from trainwarden.agent.replica import compact
from trainwarden.agent.samples import Universe
from trainwarden.collector.health.samples import skipping_rollbacks
from trainwarden.collector.ingest.samples import unpack
from trainwarden.collector.store import models as m

WINDOW_S = 3600.0
"""Epoch ends this recent are looked at (an index range of the run's events)."""
WAIT_ALL_S = 60.0
"""An epoch is judged without the ranks that did not end it this long after the first."""
SETTLE_S = 5.0
"""A rank's rows up to its last step of the epoch are waited for this long."""
TOLERANCE = 0.0
"""Repeats or missing samples past ``world - 1`` plus this share of the dataset: a warning."""
EXAMPLES = 10


def ended_runs(conn: Connection, *, now: float) -> list[tuple[int, int]]:
    """Runs no longer running with an epoch end this recent: (id, world size)."""
    e, ru = m.events.c, m.runs.c
    return [
        (run_id, world)
        for run_id, world in conn.execute(
            select(ru.id, ru.world_size).where(
                ru.status != "running",
                select(e.run_id)
                .where(e.run_id == ru.id, e.ts >= now - 120.0, e.kind == "epoch_end")
                .exists(),
            )
        )
    ]


def judge(
    conn: Connection, *, run_id: int, world: int, now: float, ended: bool = False
) -> list[dict[str, Any]]:
    """The events of the run's epochs that every rank ended since the last pass."""
    e = m.events.c
    ends: dict[int, dict[int, tuple[float, dict[str, Any]]]] = defaultdict(dict)
    for rank, ts, data in conn.execute(
        select(e.rank, e.ts, e.data).where(
            e.run_id == run_id, e.ts >= now - WINDOW_S, e.kind == "epoch_end"
        )
    ):
        if isinstance(data, dict) and data.get("dataset_size") and rank is not None:
            ends[int(data["epoch"])][rank] = (ts, data)
    if not ends:
        return []
    judged = {  # every epoch counted before, however long ago (one event an epoch)
        int((data or {}).get("epoch", -1))
        for data in conn.execute(
            select(e.data).where(e.run_id == run_id, e.kind == "epoch_coverage", e.rank.is_(None))
        ).scalars()
    }
    out: list[dict[str, Any]] = []
    for epoch, by_rank in sorted(ends.items()):
        if epoch in judged:
            continue
        first = min(ts for ts, _ in by_rank.values())
        everyone = set(by_rank) >= set(range(world))
        if not (ended or everyone or now - first >= WAIT_ALL_S):
            continue
        last_steps = {rank: int(data["last_step"]) for rank, (_, data) in by_rank.items()}
        settling = now - max(ts for ts, _ in by_rank.values()) < SETTLE_S
        if not ended and settling and not _rows_in(conn, run_id, epoch, last_steps):
            continue
        facts = max((data for _, data in by_rank.values()), key=lambda d: d["last_step"])
        out += _count(
            conn,
            run_id=run_id,
            epoch=epoch,
            size=int(facts["dataset_size"]),
            kept=int(facts["kept"]),
            world=world,
            ranks=sorted(by_rank),
            dropped=sum(int(data.get("dropped") or 0) for _, data in by_rank.values()),
        )
    return out


def _rows_in(conn: Connection, run_id: int, epoch: int, last_steps: dict[int, int]) -> bool:
    """Whether each rank's row of its last step of the epoch is stored."""
    d = m.sample_digests.c
    have = {
        (rank, step)
        for rank, step in conn.execute(
            select(d.rank, d.step).where(
                d.run_id == run_id,
                d.step.in_(set(last_steps.values())),
                d.rank.in_(list(last_steps)),
            )
        )
    }
    return all((rank, step) in have for rank, step in last_steps.items())


def _permutation(size: int) -> tuple[int, int]:
    """``(a, b)`` of the agent's sample of a dataset of ``size``: the agent's own
    (agent/samples.py's Universe), so the two cannot drift apart."""
    universe = Universe(size)
    return universe.a, universe.b


def in_sample(size: int, kept: int) -> Any:
    """Whether an id of ``[0, size)`` is in the agent's coverage sample."""
    if kept >= size:
        return lambda i: True
    a, b = _permutation(size)
    return lambda i: (a * i + b) % size < kept


def sample_ids(size: int, kept: int) -> Any:
    """The ids of the coverage sample, ``kept`` of them (the permutation's preimage of
    ``[0, kept)``): all of ``[0, size)`` in order when it holds every id."""
    if kept >= size:
        return iter(range(size))
    a, b = _permutation(size)
    inverse = pow(a, -1, size)
    return ((inverse * (j - b)) % size for j in range(kept))


def _count(
    conn: Connection,
    *,
    run_id: int,
    epoch: int,
    size: int,
    kept: int,
    world: int,
    ranks: list[int],
    dropped: int = 0,
) -> list[dict[str, Any]]:
    d = m.sample_digests.c
    rows = conn.execute(
        select(d.step, d.rank, d.kept)
        .where(d.run_id == run_id, d.epoch == epoch, d.kept.is_not(None))
        .order_by(d.step, d.rank)
    ).all()
    counts: Counter[int] = Counter()
    first_repeat: int | None = None
    outside = 0
    sampled = in_sample(size, kept)
    for step, _rank, data in rows:
        ids = unpack(data)
        for i in ids:
            if not 0 <= i < size or not sampled(i):
                if not 0 <= i < size:
                    outside += 1
                continue
            if first_repeat is None and i in counts:
                first_repeat = step
            counts[i] += 1
    seen = sum(counts.values())
    distinct = len(counts)
    duplicated, missing = seen - distinct, kept - distinct
    repeated = [i for i, n in counts.items() if n > 1][:EXAMPLES]
    where: dict[int, list[list[int]]] = {i: [] for i in repeated}
    if repeated:
        wanted = set(repeated)
        for step, rank, data in rows:
            for i in unpack(data):
                if i in wanted:
                    where[i].append([int(step), int(rank)])
    absent: list[int] = []
    if missing:
        for i in sample_ids(size, kept):
            if i not in counts:
                absent.append(i)
                if len(absent) == EXAMPLES:
                    break
    exact = kept >= size
    scale = size / kept
    steps = [int(rows[0].step), int(rows[-1].step)] if rows else None
    per_step = seen * scale / max(1, len({int(r.step) for r in rows}))
    skipped = _skipped_batches(conn, run_id, steps) if steps else 0
    drifts = _drifts(conn, run_id, steps) if steps else []
    found: dict[str, Any] = {
        "epoch": epoch,
        "dataset_size": size,
        "exact": exact,
        "kept": kept,
        "seen": round(seen * scale),
        "distinct": round(distinct * scale),
        "duplicated": round(duplicated * scale),
        "missing": round(missing * scale),
        "out_of_range": outside,
        "duplicated_error": 0.0 if exact else round(math.sqrt(duplicated) * scale, 1),
        "missing_error": 0.0 if exact else round(math.sqrt(missing) * scale, 1),
        "first_duplicate_step": first_repeat,
        "duplicate_examples": [{"id": i, "at": where[i]} for i in repeated],
        "missing_examples": absent,
        "ranks": compact(ranks),
        "steps": steps,
        "allowance": world - 1 + TOLERANCE * size,
        # and for missing ones: what the loaders drop by design (drop_last), and the
        # batches a rollback skipped on purpose (its skip window, at this epoch's rate)
        "dropped": dropped,
        "skipped_by_rollback": round(skipped * per_step),
        "missing_allowance": world - 1 + TOLERANCE * size + dropped + round(skipped * per_step),
        # where a resume or a replay left the data's path in this epoch (data_order_drift):
        # the missing samples include the ones it skipped, the repeats the ones it re-fed
        "order_drift": drifts,
    }
    how = "" if exact else f" (estimated from 1 in {scale:.3g} samples)"
    found["reason"] = (
        f"epoch {epoch}: {found['distinct']:,} of {size:,} samples trained on{how}, "
        f"{found['duplicated']:,} repeated, {found['missing']:,} never seen"
        + (f", {outside:,} ids outside the dataset" if outside else "")
        + (
            f" ({found['skipped_by_rollback']:,} in a rollback's skip window)"
            if found["skipped_by_rollback"]
            else ""
        )
        + (
            f"; the data left its path at step {drifts[0]['step']} (data_order_drift): the "
            "samples never seen include the ones it skipped, the repeated ones the re-fed"
            if drifts and (missing or duplicated)
            else ""
        )
    )
    step = steps[1] if steps else None
    events = [_event("epoch_coverage", "info", run_id, epoch, step, found)]
    if found["duplicated"] - 2 * found["duplicated_error"] > found["allowance"]:
        first = f", the first at step {first_repeat}" if first_repeat is not None else ""
        events.append(
            _event(
                "data_duplicated",
                "warning",
                run_id,
                epoch,
                first_repeat if first_repeat is not None else step,
                {
                    **found,
                    "reason": f"epoch {epoch}: {found['duplicated']:,} samples trained on "
                    f"more than once{how}{first}",
                },
            )
        )
    if found["missing"] - 2 * found["missing_error"] > found["missing_allowance"]:
        events.append(
            _event(
                "data_skipped",
                "warning",
                run_id,
                epoch,
                step,
                {
                    **found,
                    "reason": f"epoch {epoch}: {found['missing']:,} of {size:,} samples "
                    f"never trained on{how}",
                },
            )
        )
    return events


def _skipped_batches(conn: Connection, run_id: int, steps: list[int]) -> int:
    """Batches the run's rollbacks restored into ``[first, last]`` skipped on purpose."""
    return sum(
        batches for at, _, batches in skipping_rollbacks(conn, run_id) if steps[0] <= at <= steps[1]
    )


def _drifts(conn: Connection, run_id: int, steps: list[int]) -> list[dict[str, Any]]:
    """The ``data_order_drift`` events of the run at steps ``[first, last]``."""
    e = m.events.c
    return [
        {"step": int(step), "attempt": (data or {}).get("attempt")}
        for step, data in conn.execute(
            select(e.step, e.data)
            .where(
                e.run_id == run_id,
                e.kind == "data_order_drift",
                e.step >= steps[0],
                e.step <= steps[1],
            )
            .order_by(e.step)
        )
    ]


def _event(
    kind: str, severity: str, run_id: int, epoch: int, step: int | None, data: dict[str, Any]
) -> dict[str, Any]:
    return {
        "rank": None,
        "kind": kind,
        "severity": severity,
        "step": step,
        "uid": f"{kind}:{run_id}:{epoch}",
        "data": data,
    }
