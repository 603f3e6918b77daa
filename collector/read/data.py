"""Reading a run's data integrity: each judged epoch's coverage (samples trained on, twice,
never), the realized data mixture against the declared one, and the data events.

All of it is what the collector already found (``health/coverage.py``,
``health/mixture.py``, ``health/samples.py``): this module reads its events and, for the
mixture, reads the declared weights and the realized tokens (``read/mixture.py``). Only the
collector's own findings are read (``rank`` null): an agent may send an event of any kind.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import Connection, select

from trainwarden.collector.read import mixture as mix
from trainwarden.collector.read.queries import run_id_of
from trainwarden.collector.store import models as m

MAX_EPOCHS = 100
"""Judged epochs answered: the newest."""
MAX_EVENTS = 50
"""Data events answered: the newest."""
EVENT_KINDS = (
    "duplicate_batch",
    "data_order_drift",
    "data_duplicated",
    "data_skipped",
    "data_mixture_drift",
)


class DuplicateExample(BaseModel):
    id: int = Field(description="A sample id trained on more than once in the epoch")
    at: list[list[int]] = Field(description="Where: [step, rank] of each time")


class EpochCoverage(BaseModel):
    """One judged epoch (an ``epoch_coverage`` event's data)."""

    epoch: int
    dataset_size: int
    exact: bool = Field(description="Counted on every id; else on a fixed sample, scaled")
    kept: int = Field(description="The ids counted: the dataset, or its sample")
    seen: int = Field(description="Samples trained on in the epoch")
    distinct: int
    duplicated: int = Field(description="Extra occurrences: seen - distinct")
    missing: int = Field(description="Samples never trained on: dataset_size - distinct")
    out_of_range: int = 0
    duplicated_error: float = Field(default=0.0, description="Standard error (0 when exact)")
    missing_error: float = 0.0
    first_duplicate_step: int | None = None
    duplicate_examples: list[DuplicateExample] = []
    missing_examples: list[int] = []
    ranks: str | None = Field(default=None, description="The ranks that ended it, e.g. 0-3")
    steps: list[int] | None = Field(default=None, description="[first, last] step")
    allowance: float | None = Field(
        default=None, description="Repeats or missing samples allowed before a warning"
    )
    missing_allowance: float | None = Field(
        default=None,
        description="Missing samples allowed before a warning: the allowance, plus what the "
        "loaders drop by design and what a rollback's skip window left out",
    )
    dropped: int = Field(default=0, description="Samples the loaders declared they drop")
    skipped_by_rollback: int = Field(
        default=0, description="Samples in the skip windows of rollbacks into the epoch"
    )
    reason: str = ""
    step: int | None = Field(default=None, description="The event's step")
    ts: float
    duplicated_past: bool = Field(description="A data_duplicated warning for this epoch")
    skipped_past: bool = Field(description="A data_skipped warning for this epoch")


class Mixture(BaseModel):
    declared: dict[str, float] | None = Field(
        description="tw.init(data_mixture=...): the weights; null when not declared"
    )
    realized: dict[str, float] = Field(description="Each source's share of the window's tokens")
    tokens: dict[str, int] = Field(description="Tokens by source over the window")
    window: list[int] | None = Field(description="[first, last] step of the window")
    steps: int = Field(description="Steps in the window that reported sources")
    tolerance: dict[str, float] = Field(
        description="How far each declared source's share may be off its weight (absolute)"
    )


class DataEvent(BaseModel):
    kind: str
    step: int | None
    ts: float
    severity: str
    reason: str
    data: dict[str, Any]


class RunData(BaseModel):
    """A run's data integrity, as the collector judged it."""

    coverage: list[EpochCoverage] = Field(description="Judged epochs, newest first")
    mixture: Mixture
    events: list[DataEvent] = Field(description="The newest data events, newest first")


def coverage(conn: Connection, run_id: int, *, limit: int = MAX_EPOCHS) -> list[EpochCoverage]:
    """The newest ``limit`` judged epochs, newest first, each flagged when a warning
    (``data_duplicated``, ``data_skipped``) was raised for it."""
    e = m.events.c
    mine = (e.run_id == run_id, e.rank.is_(None))
    past: dict[str, set[int]] = {"data_duplicated": set(), "data_skipped": set()}
    for kind, data in conn.execute(select(e.kind, e.data).where(*mine, e.kind.in_(tuple(past)))):
        if isinstance(data, dict) and isinstance(data.get("epoch"), int):
            past[kind].add(data["epoch"])
    rows = conn.execute(
        select(e.step, e.ts, e.data)
        .where(*mine, e.kind == "epoch_coverage")
        .order_by(e.ts.desc(), e.id.desc())
        .limit(limit)
    ).all()
    out: dict[int, EpochCoverage] = {}
    for step, ts, data in rows:
        if not isinstance(data, dict):
            continue
        try:
            found = EpochCoverage.model_validate(
                {
                    **data,
                    "step": step,
                    "ts": ts,
                    "duplicated_past": data.get("epoch") in past["data_duplicated"],
                    "skipped_past": data.get("epoch") in past["data_skipped"],
                }
            )
        except ValidationError:  # not the collector's form: left out, not a 500
            continue
        out.setdefault(found.epoch, found)  # the newest judgment of an epoch
    return [out[epoch] for epoch in sorted(out, reverse=True)]


def mixture(conn: Connection, run_id: int) -> Mixture:
    """The declared weights, and each source's share of the tokens of the run's newest
    steps (the window the drift check compares, rounded as its events are)."""
    tokens, window, steps = mix.realized(conn, run_id)
    declared = mix.declared(conn, run_id)
    return Mixture(
        declared=declared,
        realized={s: round(v, 4) for s, v in sorted(mix.shares(tokens).items())},
        tokens=dict(sorted(tokens.items())),
        window=window,
        steps=steps,
        tolerance={s: round(mix.tolerance(w), 4) for s, w in (declared or {}).items()},
    )


def events(conn: Connection, run_id: int, *, limit: int = MAX_EVENTS) -> list[DataEvent]:
    """The newest ``limit`` data events, newest first."""
    e = m.events.c
    rows = conn.execute(
        select(e.kind, e.step, e.ts, e.severity, e.data)
        .where(e.run_id == run_id, e.rank.is_(None), e.kind.in_(EVENT_KINDS))
        .order_by(e.ts.desc(), e.id.desc())
        .limit(limit)
    ).all()
    return [
        DataEvent(
            kind=kind,
            step=step,
            ts=ts,
            severity=severity,
            reason=str(data.get("reason") or kind) if isinstance(data, dict) else kind,
            data=data if isinstance(data, dict) else {},
        )
        for kind, step, ts, severity, data in rows
    ]


def view(conn: Connection, *, run: str) -> RunData:
    """The run's epochs, mixture and data events (``NotFound``: no such run)."""
    run_id = run_id_of(conn, run)
    return RunData(
        coverage=coverage(conn, run_id),
        mixture=mixture(conn, run_id),
        events=events(conn, run_id),
    )
