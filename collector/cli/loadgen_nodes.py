"""The load generator's simulated nodes: what one is (``SimulatedNode``), its two ways
of sending (``run_node``: a request a step, a refused one dropped; ``run_agent_node``:
as agents do, with a spool and replays) and what they count (``LoadgenResult``).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainwarden.agent import wire
from trainwarden.collector.cli.loadgen_bodies import METRIC_COLUMNS, node_body, rank_body
from trainwarden.collector.cli.loadgen_http import KeepAliveConnection


@dataclass
class LoadgenResult:
    ranks: int
    nodes: int
    steps: int
    requests_ok: int = 0
    requests_failed: int = 0
    rows: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    # With ``replay``: requests taken on a later try or held back behind a refused one,
    # and rows still unsent when the drain time ran out (lost, were the load generator
    # a node's agents).
    requests_replayed: int = 0
    rows_unsent: int = 0
    # Step due (the trainer's step done) -> the collector's 200 (after its commit: the
    # rows are queryable): for the requests taken at the first try, and for the others
    # (refused, or held back behind a refused one: a step done while its node's spool
    # waited or drained).
    fresh_s: list[float] = field(default_factory=list)
    replayed_s: list[float] = field(default_factory=list)
    # Rows taken by the end of the offered load (the last step's period); the last
    # take, in seconds from the start (past ``seconds_offered`` while spools drain).
    rows_in_window: int = 0
    seconds_offered: float = 0.0
    last_taken_s: float = 0.0
    own_lag_s: list[float] = field(default_factory=list)  # its own event loop's lateness
    errors: list[str] = field(default_factory=list)
    user_metrics: int = 0
    sample_ids: int = 0

    @property
    def metrics_per_row(self) -> int:
        return len(METRIC_COLUMNS) + self.user_metrics

    @property
    def points(self) -> int:
        return self.rows * self.metrics_per_row

    def summary(self) -> str:
        lat = sorted(self.latencies_s) or [math.nan]
        p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000  # noqa: E731
        return (
            f"{self.ranks} ranks on {self.nodes} nodes, {self.steps} steps in {self.seconds:.1f}s, "
            f"{self.metrics_per_row} metrics a row"
            f"{f' and {self.sample_ids} sample ids' if self.sample_ids else ''}: "
            f"{self.rows / self.seconds:,.0f} rows/s = {self.points / self.seconds:,.0f} points/s; "
            f"requests {self.requests_ok} ok, {self.requests_failed} failed; "
            f"latency p50 {p(0.5):.0f} ms, p95 {p(0.95):.0f} ms, max {lat[-1] * 1000:.0f} ms"
            + (
                f"; {self.requests_replayed} taken on a later try, {self.rows_unsent} rows "
                f"unsent when the drain time ran out"
                if self.requests_replayed or self.rows_unsent
                else ""
            )
        )


@dataclass
class SimulatedNode:
    """One simulated node: its ranks, the steps they do, and the connection it sends on."""

    client: KeepAliveConnection
    result: LoadgenResult
    run: str
    world: int
    ranks: range
    steps: int
    period_s: float
    start: float
    slow_rank: int | None
    on_sent: Callable[[int, float], None] | None
    user: int
    per_rank: bool = False
    sample_ids: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.ranks.start)
        self.sessions = {r: uuid.uuid4().hex for r in self.ranks}
        # Who sends, readable without the body: a collector too busy to take the
        # request still counts it as these ranks' heartbeat.
        first, last = self.ranks.start, self.ranks.stop - 1
        self.sender = f"{wire.SENDER_HEADER}: {self.run}/{first}-{last}\r\n"
        self.path = wire.INGEST_PATH if self.per_rank else wire.COLUMNS_PATH

    def due(self, step: int) -> float:
        """When ``step`` ends (call in step order: the jitter is drawn)."""
        return self.start + step * self.period_s + self.rng.random() * self.period_s * 0.2

    def body(self, step: int) -> dict[str, Any]:
        body = node_body(
            run=self.run,
            world=self.world,
            ranks=self.ranks,
            step=step,
            period_s=self.period_s,
            sessions=self.sessions,
            rng=self.rng,
            slow_rank=self.slow_rank,
            user=self.user,
            sample_ids=self.sample_ids,
        )
        return rank_body(body) if self.per_rank else body

    async def post(self, body: bytes) -> tuple[int, float]:
        """Send ``body``: the answer's status (0: none came) and when it came."""
        result, sent, status = self.result, time.monotonic(), 0
        try:
            status, payload = await self.client.post(self.path, body, self.sender)
            if status != 200 and len(result.errors) < 5:
                result.errors.append(f"{status}: {payload[:200].decode(errors='replace')}")
        except Exception as exc:
            if len(result.errors) < 5:
                result.errors.append(repr(exc))
        answered = time.monotonic()
        result.latencies_s.append(answered - sent)
        return status, answered

    def taken(self, steps: list[int]) -> None:
        self.result.requests_ok += 1
        self.result.rows += len(self.ranks) * len(steps)
        if self.on_sent is not None:
            for step in steps:
                self.on_sent(step, time.time())


async def run_node(node: SimulatedNode) -> None:
    """A request a step, in turn; a refused one is counted and dropped."""
    import orjson

    await asyncio.sleep(node.rng.random() * node.period_s)  # nodes are not all in phase
    for step in range(node.steps):
        due = node.due(step)
        if (delay := due - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        status, _ = await node.post(orjson.dumps(node.body(step)))
        if status == 200:
            node.taken([step])
        else:
            node.result.requests_failed += 1


REPLAY_BACKOFF_S = 0.5  # the agents' first backoff where an answer names no Retry-After
DRAIN_S = 120.0  # with ``replay``: how long after the last step a node goes on resending
MAX_MERGED_STEPS = 64  # steps one request carries at most (an agent's batch, 512 records)


@dataclass
class _Batch:
    """A request a node has made and the collector has not taken yet: its steps, when
    each was done, its body."""

    steps: list[int]
    dues: list[float]
    body: bytes
    tries: int = 0
    held: bool = False  # made while the spool waited: held back by an earlier refusal


def _merged(bodies: list[dict[str, Any]], per_rank: bool) -> dict[str, Any]:
    """Several steps' bodies of one node as one request (the newest headers)."""
    if len(bodies) == 1:
        return bodies[0]
    merged = dict(bodies[-1])
    if per_rank:
        merged["steps"] = [row for body in bodies for row in body["steps"]]
    else:
        merged["steps"] = {
            k: [v for body in bodies for v in body["steps"][k]] for k in merged["steps"]
        }
    return merged


async def run_agent_node(node: SimulatedNode) -> None:
    """A node whose agents (and relay) keep what the collector does not take, as
    agent/exporter.py does: the steps recorded while a request was out go in the next
    request, together; a refused request (503, 429, 5xx, no answer) goes to the spool,
    with every newer batch while it waits, and the spool is sent oldest first, a
    request a batch, once the answer's Retry-After has passed; after the last step the
    node goes on draining it for up to ``DRAIN_S``."""
    import orjson

    result = node.result
    # Steps done, not yet sent, each with whether the spool held something when it was
    # done: such a step waits behind a refusal (while the spool waits and drains), and
    # counts as held back, not as taken at the first try.
    recorded: list[tuple[int, float, dict[str, Any], bool]] = []
    spool: list[_Batch] = []
    retry_at = 0.0

    def batch() -> _Batch:
        taken = recorded[:MAX_MERGED_STEPS]
        del recorded[:MAX_MERGED_STEPS]
        body = _merged([b for _, _, b, _ in taken], node.per_rank)
        made = _Batch([s for s, *_ in taken], [d for _, d, *_ in taken], orjson.dumps(body))
        made.held = any(behind for *_, behind in taken)
        return made

    async def send(batch: _Batch) -> bool:
        nonlocal retry_at
        status, answered = await node.post(batch.body)
        batch.tries += 1
        rows = len(node.ranks) * len(batch.steps)
        if status == 200:
            node.taken(batch.steps)
            result.requests_replayed += batch.tries > 1 or batch.held
            if answered - node.start <= result.seconds_offered:
                result.rows_in_window += rows
            result.last_taken_s = max(result.last_taken_s, answered - node.start)
            fresh = result.fresh_s if batch.tries == 1 and not batch.held else result.replayed_s
            fresh.extend(answered - due for due in batch.dues)
            return True
        result.requests_failed += 1
        if status and status not in wire.RETRYABLE:
            result.rows_unsent += rows
            return True  # a malformed request is never taken: agents drop it too
        retry_at = answered + (node.client.retry_after or REPLAY_BACKOFF_S)
        return False

    dues = [node.due(k) for k in range(node.steps)]
    deadline = dues[-1] + node.period_s + DRAIN_S
    step = 0
    while time.monotonic() < deadline:
        now = time.monotonic()
        while step < node.steps and dues[step] <= now:
            recorded.append((step, dues[step], node.body(step), bool(spool)))
            step += 1
        if spool and now >= retry_at:
            if await send(spool[0]):
                spool.pop(0)
            continue
        if recorded:
            if spool:  # the collector asked to wait: behind what waits
                spool.append(held := batch())
                held.held = True
            elif not await send(pending := batch()):
                spool.append(pending)
            continue
        if step >= node.steps and not spool:
            break
        wake = dues[step] if step < node.steps else deadline
        await asyncio.sleep(max(0.0, min(wake, retry_at if spool else wake) - now))
    left = sum(len(b.steps) for b in spool) + len(recorded)
    result.rows_unsent += len(node.ranks) * left
