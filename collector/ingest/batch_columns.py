"""A flush's batches as the bulk writer takes them: column-wise requests (an agent's
batches of one run merged, a node's columns, a relay's extras), each run's headers
column-wise, and how many records a batch carries."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Container
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schema_events import EventIn
from trainwarden.collector.ingest.schema_gpu import GpuSampleIn
from trainwarden.collector.ingest.schema_steps import StepIn
from trainwarden.collector.ingest.schemas import AGENT_FIELDS, AgentInfo, IngestBatch
from trainwarden.collector.ingest.steps import take_rows


@dataclass
class Request:
    """One validated request, in the shape the bulk writer takes."""

    run: str
    world_size: int
    heads: dict[str, list[Any]]  # the ranks' headers, column-wise: AgentInfo's fields
    top: list[int | None]  # each header's rank: its highest step number here (None: none)
    low: list[int | None]  # ... and its lowest
    steps: dict[str, list[Any]]  # step columns: "rank" and StepIn fields, of one length
    agent: AgentInfo | None = None  # one agent's batch: its header (events and GPU samples)
    events: list[EventIn] = field(default_factory=list)
    gpu: list[GpuSampleIn] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)  # when each header's request came
    origin: list[int] = field(default_factory=list)  # each header's batch in the flush


_STEP_FIELDS = tuple(StepIn.model_fields)
_step_values = itemgetter(*_STEP_FIELDS)
_STEP_AT = _STEP_FIELDS.index("step")
_agent_values = itemgetter(*AGENT_FIELDS)


def merged_steps(group: list[Request]) -> dict[str, list[Any]]:
    """The step columns of several requests of one run as one set of columns, in the
    requests' order (a column one of them did not send is NULL in its rows)."""
    if len(group) == 1:
        return group[0].steps
    names = dict.fromkeys(itertools.chain.from_iterable(req.steps for req in group))
    return {
        name: list(
            itertools.chain.from_iterable(
                req.steps.get(name) or [None] * len(req.steps["step"]) for req in group
            )
        )
        for name in names
    }


def _agents(batches: list[IngestBatch], arrived: list[float], origin: list[int]) -> Request:
    """Several agents' batches of one run (consecutive in a flush) as one request of
    columns, as a node's relay would have sent them: their headers and steps transposed
    at once, in order. On the direct path (a request a rank) a flush holds hundreds of
    one-step batches; a request each cost the writer about as much as its rows did."""
    heads = dict(
        zip(
            AGENT_FIELDS,
            map(list, zip(*(_agent_values(b.agent.__dict__) for b in batches), strict=True)),
            strict=True,
        )
    )
    steps: dict[str, list[Any]] = {}
    # The fields' values as validated (a StepIn holds plain values: no model_dump copy).
    if all(len(b.steps) == 1 for b in batches):  # a step a request: the usual
        rows = [_step_values(b.steps[0].__dict__) for b in batches]
        steps["rank"] = heads["rank"]
        top = low = [row[_STEP_AT] for row in rows]
    else:
        rows = [_step_values(s.__dict__) for b in batches for s in b.steps]
        steps["rank"] = [b.agent.rank for b in batches for _ in b.steps]
        top = [max((s.step for s in b.steps), default=None) for b in batches]
        low = [min((s.step for s in b.steps), default=None) for b in batches]
    if rows:
        steps.update(zip(_STEP_FIELDS, map(list, zip(*rows, strict=True)), strict=True))
    else:
        steps = {}
    world = max(b.agent.world_size for b in batches)
    return Request(batches[0].run, world, heads, top, low, steps, arrived=arrived, origin=origin)


def _agent_extras(batch: IngestBatch) -> Request | None:
    """An agent's events and GPU samples, apart from its steps (see :func:`_agents`)."""
    if not batch.events and not batch.gpu:
        return None
    empty: list[Any] = []
    heads = {name: empty for name in AGENT_FIELDS}
    return Request(
        batch.run, batch.agent.world_size, heads, [], [], {}, batch.agent, batch.events, batch.gpu
    )


def _normalize(batch: ColumnarBatch, at: float, i: int, drop: set[int]) -> Request | None:
    """A node's columns as a request; ``drop``: ranks whose rows are refused (None when
    that leaves no rank)."""
    cols, heads = batch.columns(), batch.header_columns()
    if drop:
        heads = take_rows(heads, [k for k, rank in enumerate(heads["rank"]) if rank not in drop])
        if not heads["rank"]:
            return None
        if cols:
            cols = take_rows(cols, [k for k, rank in enumerate(cols["rank"]) if rank not in drop])
            cols = cols if cols["rank"] else {}
    if cols.get("rank") == heads["rank"]:  # a row a rank, in the headers' order: the usual
        top = low = cols["step"]
    else:
        by_rank: dict[int, list[int]] = defaultdict(list)
        for rank, step in zip(cols.get("rank", ()), cols.get("step", ()), strict=True):
            by_rank[rank].append(step)
        top = [max(by_rank[r]) if r in by_rank else None for r in heads["rank"]]
        low = [min(by_rank[r]) if r in by_rank else None for r in heads["rank"]]
    n = len(top)
    return Request(
        batch.run, batch.world_size, heads, top, low, cols, arrived=[at] * n, origin=[i] * n
    )


def requests_of(
    batches: list[IngestBatch | ColumnarBatch],
    when: list[float],
    refused: Container[tuple[int, int]] = (),
) -> tuple[list[Request], list[int | None]]:
    """The flush's batches as the writer takes them, with each request's batch (None: a
    request of several agents' batches). An agent's batch gives its steps and header to
    :func:`_agents`, with the same run's agent batches around it that no node's columns
    come between (within a run the order decides which header and which execution of a
    step is the newest), and its events and GPU samples to a request of their own. A
    node's columns are one request, and one more for each of its ``extras`` (a relay's
    per-rank events and GPU samples). ``refused``: (batch, rank) pairs left out whole
    (another process holds the rank: claims.py)."""
    requests: list[Request] = []
    owner: list[int | None] = []
    # Since the run's last node: its agents' batches, when each came, and their places.
    gathered: dict[str, tuple[list[IngestBatch], list[float], list[int]]] = {}

    def close(run: str) -> None:
        if (got := gathered.pop(run, None)) is not None:
            requests.append(_agents(*got))
            owner.append(None)

    for i, batch in enumerate(batches):
        if isinstance(batch, IngestBatch):
            if refused and (i, batch.agent.rank) in refused:
                continue
            agents, at, places = gathered.setdefault(batch.run, ([], [], []))
            agents.append(batch)
            at.append(when[i])
            places.append(i)
            if (extras := _agent_extras(batch)) is not None:
                requests.append(extras)
                owner.append(i)
            continue
        if gathered:
            close(batch.run)
        drop = (
            {rank for rank in batch.header_columns()["rank"] if (i, rank) in refused}
            if refused
            else set()
        )
        if (node := _normalize(batch, when[i], i, drop)) is not None:
            requests.append(node)
            owner.append(i)
        for extra in batch.extras:
            if extra.agent.rank in drop:
                continue
            requests.append(_agents([extra], [when[i]], [i]))
            owner.append(i)
            if (extras := _agent_extras(extra)) is not None:
                requests.append(extras)
                owner.append(i)
    for run in list(gathered):
        close(run)
    return requests, owner


def batch_rows(batch: IngestBatch | ColumnarBatch) -> int:
    """How many records a validated batch carries (what the writer's bound counts)."""
    if isinstance(batch, IngestBatch):
        return len(batch.steps) + len(batch.events) + len(batch.gpu) + 1
    return (
        len(batch.steps.get("rank", ()))
        + len(batch.header_columns()["rank"])
        + sum(map(batch_rows, batch.extras))
    )


def heads_by_run(
    requests: list[Request], run_ids: dict[str, int]
) -> dict[int, dict[str, list[Any]]]:
    """Each run's headers in the flush, column-wise in flush order, with ``top`` (each
    header's highest step), ``arrived`` and ``origin`` (its batch)."""
    of_run: dict[int, list[Request]] = defaultdict(list)
    for req in requests:
        if req.top:  # a request of events and GPU samples alone has no header here
            of_run[run_ids[req.run]].append(req)
    by_run: dict[int, dict[str, list[Any]]] = {}
    for run_id, sent in of_run.items():
        if len(sent) == 1:  # one request of the run's headers: the direct path's usual
            heads = by_run[run_id] = dict(sent[0].heads)
        else:
            heads = by_run[run_id] = {
                name: list(itertools.chain.from_iterable(req.heads[name] for req in sent))
                for name in AGENT_FIELDS
            }
        for name in ("top", "arrived", "origin"):
            heads[name] = list(itertools.chain.from_iterable(getattr(r, name) for r in sent))
    return by_run
