"""``trainwarden loadgen``: synthetic ranks for benchmarks and capacity tests.

Each simulated node sends one request per training step with its ranks' rows
(``POST /api/v1/ingest/columns``), as its node relay (``trainwarden relay``) does; with
``--no-relay`` each rank sends its own (``POST /api/v1/ingest``), as agents do with no
relay. Values are
plausible: step times around the step period with jitter and a slow rank now and
then, a falling loss, MFU, the communication split, memory; and ``user_metrics`` of
the trainer's own (``s.metric``: a learning-rate schedule, MoE aux and z losses, ...).
With ``sample_ids`` (``--sample-ids N``) every row also carries the step's sample ids as
an agent sends them with a dataset size (``s.samples(ids)``, agent/samples.py): their
digest, count and epoch, and the ids themselves (``samples_kept``): a shuffling
sampler's batches of a dataset of 2**20 samples (:func:`sample_columns`).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import struct
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from trainwarden.agent import wire

# The numeric per-rank metrics each row carries (what "points" counts).
METRIC_COLUMNS = (
    "duration_s",
    "data_wait_s",
    "tokens",
    "loss",
    "grad_norm",
    "fwd_s",
    "bwd_s",
    "opt_s",
    "other_s",
    "compute_s",
    "exposed_comm_s",
    "overlapped_comm_s",
    "idle_s",
    "flops",
    "mfu",
    "peak_flops",
    "mem_allocated_bytes",
    "mem_reserved_bytes",
    "rss_bytes",
)
USER_METRICS = 6  # default: 19 built-in + 6 = the 25 metrics a row of issue 5's benchmark
MAX_USER_METRICS = 32
MAX_SAMPLE_IDS = 65_536  # what the collector takes a row (agent/samples.py's MAX_IDS)


def _lr(step: int) -> float:
    # Linear warm-up over 100 steps to 3e-4, then a cosine decay over 10,000 steps to 3e-5.
    if step < 100:
        return 3e-4 * (step + 1) / 100
    return 3e-5 + 0.5 * (3e-4 - 3e-5) * (1 + math.cos(math.pi * min(1.0, (step - 100) / 10_000)))


# Standard normal draws the simulated values take their noise from: a node takes a
# run of them at a random place in the pool, not a fresh draw a value (random.gauss
# was a third of the load generator's CPU; it shares the machine with the collector).
def _pool(size: int, seed: int) -> list[float]:
    draw = random.Random(seed).gauss
    return [draw(0.0, 1.0) for _ in range(size)]


_NORMALS = _pool(8191, seed=20261122)


def _normals(rng: random.Random, k: int) -> list[float]:
    """``k`` standard normal values (a run of the pool; fresh draws past its size)."""
    if k > len(_NORMALS) // 2:
        return [rng.gauss(0.0, 1.0) for _ in range(k)]
    at = int(rng.random() * (len(_NORMALS) - k))
    return _NORMALS[at : at + k]


def _user_noise(count: int) -> int:
    """How many normal values :func:`user_metrics` takes for ``count`` metrics."""
    return 3 + max(0, count - 6) if count else 0


def user_metrics(
    count: int, *, step: int, rng: random.Random, z: list[float] | None = None
) -> dict[str, float]:
    """``count`` user metrics of one rank at ``step``, as a trainer logs them; ``z``:
    the normal values to use (``_user_noise(count)`` of them; default drawn here)."""
    z = _normals(rng, _user_noise(count)) if z is None else z
    if count <= 0:
        return {}
    values = {
        "lr": _lr(step),
        "moe.aux_loss": 0.01 * (1 + 0.1 * z[0]),
        "moe.load_balance": 1.0 + abs(0.05 * z[1]),
        "moe.z_loss": 1e-3 * (1 + 0.05 * z[2]),
        "loss_scale": 65536.0,
        "tokens_seen": float(step * 16384),
    }
    if count <= len(values):
        return dict(list(values.items())[:count])
    for i in range(len(values), count):  # more: auxiliary losses of a multi-task model
        values[f"aux.loss{i}"] = 0.1 * (1 + 0.1 * z[i - 3])
    return values


DATASET = 1_048_576
"""The simulated dataset's size with ``sample_ids``: the largest an agent sends every id
of (agent/samples.py's ``EXACT_MAX``); larger where a step's ids would not fit in it."""


def sample_columns(*, world: int, ranks: range, step: int, count: int) -> dict[str, list[Any]]:
    """The samples columns of one node's rows at ``step``, ``count`` ids a rank, as an
    agent sends them with a dataset size: the digest (BLAKE2b-8 of the ids as
    little-endian int64, agent/samples.py), the count, the epoch and the ids themselves
    (``samples_kept``: all of them, the dataset being at most ``EXACT_MAX``).

    A shuffling sampler's batches: rank ``r`` takes the positions ``(step * world + r) *
    count`` to ``... + count - 1`` of the epoch's order of the :func:`dataset`, a fixed
    affine shuffle ``i -> (a * i + b_epoch) mod size`` redrawn each epoch: distinct ids
    on the ranks of a step (no two share a digest), each id once an epoch, spread over
    the dataset as a shuffled order spreads them (which matters to what PostgreSQL's
    compression of the stored ids costs: consecutive ids compress better)."""
    size = dataset(world, count)
    mask, a, spread = size - 1, _multiplier(size), _spreads(size, count)
    pack = _id_packer(count)
    kept, epochs = [], []
    first = (step * world + ranks.start) * count
    for position in range(first, first + len(ranks) * count, count):
        epoch = position // size
        start = a * (position & mask) + epoch * 0x9E3779B1  # b_epoch: a shift an epoch
        kept.append([(start + x) & mask for x in spread])
        epochs.append(epoch)
    return {
        "samples_digest": [hashlib.blake2b(pack(*ids), digest_size=8).hexdigest() for ids in kept],
        "samples_count": [count] * len(ranks),
        "samples_epoch": epochs,
        "samples_kept": kept,
    }


def dataset(world: int, count: int) -> int:
    """The simulated dataset's size: :data:`DATASET`, or the power of two that holds a
    whole step's ids (``world * count``)."""
    return max(DATASET, 1 << (world * count - 1).bit_length())


def _multiplier(size: int) -> int:
    """The shuffle's ``a``: odd, so a permutation modulo a power of two."""
    return int(size * 0.6180339887498949) | 1


_SPREADS: dict[tuple[int, int], list[int]] = {}


def _spreads(size: int, count: int) -> list[int]:
    """``a * j`` for the ``count`` positions ``j`` of a batch (computed once)."""
    if (spread := _SPREADS.get((size, count))) is None:
        a = _multiplier(size)
        spread = _SPREADS[(size, count)] = [a * j for j in range(count)]
    return spread


_PACKERS: dict[int, Callable[..., bytes]] = {}


def _id_packer(count: int) -> Callable[..., bytes]:
    """``pack(*ids)``: ``count`` ids as little-endian int64 (one compiled struct a count:
    a third of what ``array("q", ids)`` costs)."""
    if (pack := _PACKERS.get(count)) is None:
        pack = _PACKERS[count] = struct.Struct(f"<{count}q").pack
    return pack


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


def node_body(
    *,
    run: str,
    world: int,
    ranks: range,
    step: int,
    period_s: float,
    sessions: dict[int, str],
    rng: random.Random,
    slow_rank: int | None,
    user: int = 0,
    sample_ids: int = 0,
) -> dict[str, Any]:
    """One node's columnar body; ``user``: user metrics per row (the ``metrics`` column);
    ``sample_ids``: sample ids per row (:func:`sample_columns`; 0: no samples columns).

    Built column by column, with no dict a row: the load generator shares the machine
    with the collector it measures, so its CPU a row is kept small."""
    now = time.time()
    n = len(ranks)
    u = _user_noise(user)
    z = _normals(rng, n * (5 + u))  # one run of normal values: 5 a row, and the user metrics'
    loss_base = 2.0 + 8.0 * math.exp(-step / 500)
    flops = 4.0e14 * period_s
    compute = [
        period_s * 0.7 * (1.3 if r == slow_rank else 1.0) * (1 + 0.02 * x)
        for r, x in zip(ranks, z[:n], strict=True)
    ]
    exposed = [period_s * 0.2 * (1 + 0.1 * x) for x in z[n : 2 * n]]
    duration = [c + e for c, e in zip(compute, exposed, strict=True)]
    cols: dict[str, list[Any]] = {
        "rank": list(ranks),
        "step": [step] * n,
        "ts": [now - d for d in duration],
        "duration_s": duration,
        "data_wait_s": [abs(0.01 + 0.003 * x) * period_s for x in z[2 * n : 3 * n]],
        "tokens": [16384] * n,
        "loss": [loss_base + 0.02 * x for x in z[3 * n : 4 * n]],
        "grad_norm": [abs(1.0 + 0.05 * x) for x in z[4 * n : 5 * n]],
        "fwd_s": [d * 0.3 for d in duration],
        "bwd_s": [d * 0.6 for d in duration],
        "opt_s": [d * 0.08 for d in duration],
        "other_s": [d * 0.02 for d in duration],
        "compute_s": compute,
        "exposed_comm_s": exposed,
        "overlapped_comm_s": [period_s * 0.15] * n,
        "idle_s": [0.0] * n,
        "flops": [flops] * n,
        "mfu": [flops / (d * 989.4e12) for d in duration],
        "peak_flops": [989.4e12] * n,
        "mem_allocated_bytes": [60 << 30] * n,
        "mem_reserved_bytes": [70 << 30] * n,
        "rss_bytes": [24 << 30] * n,
    }
    if user:
        at = 5 * n
        cols["metrics"] = [
            user_metrics(user, step=step, rng=rng, z=z[at + i * u : at + (i + 1) * u])
            for i in range(n)
        ]
    if sample_ids:
        cols |= sample_columns(world=world, ranks=ranks, step=step, count=sample_ids)
    # The ranks' headers column-wise too (agent_columns): what a node's relay sends.
    heads = {
        "rank": list(ranks),
        "local_rank": [r % n for r in ranks],
        "host": [f"node{ranks.start // n}"] * n,
        "session": [sessions[r] for r in ranks],
        "heartbeat_s": [2.0] * n,
        "last_step": [step] * n,
        "last_step_end": [now] * n,
        "in_step": [False] * n,
        "sent_at": [now] * n,
    }
    return {"run": run, "world_size": world, "agent_columns": heads, "steps": cols}


class _Connection:
    """One keep-alive HTTP/1.1 connection on asyncio streams, used by one request at a
    time: the load generator must cost little CPU, since it shares the machine with
    the collector it measures. Nodes that share a connection queue on its lock, first
    come first served (asyncio.Lock is FIFO; a shared pool behind an asyncio.Queue is
    not: a woken waiter loses its slot to a newcomer, and under load some nodes starved
    for 10 s and more, which the collector then saw as dead ranks)."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        self.host, self.port = host, port
        self.timeout = timeout_s
        token = os.environ.get("TRAINWARDEN_TOKEN")  # an ingest token, as agents take it
        self.auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.lock = asyncio.Lock()
        self.retry_after: float | None = None  # the last answer's Retry-After, in seconds
        # Opened on first use, again after the server closes it.
        self.conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def post(self, path: str, body: bytes, headers: str = "") -> tuple[int, bytes]:
        """``headers``: more header lines, each ending in CRLF. The answer's status and
        body; its ``Retry-After`` (seconds), if any, is then ``retry_after``."""
        async with self.lock:
            try:
                try:
                    return await self._exchange(path, body, headers)
                except (ConnectionError, asyncio.IncompleteReadError):
                    if self.conn is None:
                        raise
                    # The server closed an idle keep-alive connection: once more on a new one.
                    self.close()
                    return await self._exchange(path, body, headers)
            except BaseException:
                self.close()
                raise

    async def _exchange(self, path: str, body: bytes, headers: str) -> tuple[int, bytes]:
        if self.conn is None:
            self.conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.conn
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"{self.auth}{headers}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # One timeout for the whole answer (each wait_for is a task: the client's CPU).
        return await asyncio.wait_for(self._answer(reader), self.timeout)

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length, chunked = 0, False
        self.retry_after = None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"retry-after" and value.strip().isdigit():
                self.retry_after = float(value)
        if chunked:
            return status, await self._chunks(reader)
        return status, await reader.readexactly(length)

    @staticmethod
    async def _chunks(reader: asyncio.StreamReader) -> bytes:
        """A chunked body (a server may send one), read to its end."""
        parts = []
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
            pass
        return b"".join(parts)

    def close(self) -> None:
        if self.conn is not None:
            self.conn[1].close()
            self.conn = None


def rank_body(node: dict[str, Any]) -> dict[str, Any]:
    """A one-rank node body as that rank's agent sends it with no relay (``IngestBatch``)."""
    heads = node["agent_columns"]
    agent = {k: v[0] for k, v in heads.items()} | {"world_size": node["world_size"]}
    steps = {k: v[0] for k, v in node["steps"].items() if k != "rank"}
    return {"run": node["run"], "agent": agent, "steps": [steps], "events": [], "gpu": []}


@dataclass
class _Node:
    """One simulated node: its ranks, the steps they do, and the connection it sends on."""

    client: _Connection
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


async def _run_node(node: _Node) -> None:
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


async def _run_agent_node(node: _Node) -> None:
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


async def run_loadgen_async(
    *,
    url: str,
    ranks: int,
    ranks_per_node: int,
    steps_per_s: float,
    duration_s: float,
    run: str | None = None,
    slow_rank: int | None = None,
    on_sent: Callable[[int, float], None] | None = None,
    connections: int | None = None,
    user_metrics: int = USER_METRICS,
    per_rank: bool = False,
    sample_ids: int = 0,
    replay: bool = False,
) -> LoadgenResult:
    """``connections``: keep-alive connections, shared in turn by the nodes; default one
    per node, as each node's relay has its own. ``user_metrics``: per row, besides
    the built-in ones (0 to 32). ``per_rank``: every rank sends its own request to
    ``/api/v1/ingest``, on its own connection, as agents with no node relay do
    (``ranks_per_node`` is then 1). ``sample_ids``: sample ids per row with their digest,
    count and epoch (:func:`sample_columns`; 0 to 65,536; 0, the default: none).
    ``replay``: each node keeps what the collector does not take, as agents do
    (:func:`_run_agent_node`: the steps done while a request was out go in the next one; a
    refused request waits in a spool, with its node's newer ones, until the answer's
    Retry-After; what is left after ``DRAIN_S`` past the last step is ``rows_unsent``).
    Without, a node sends a request a step, in turn, and a refused one is counted in
    ``requests_failed`` and dropped."""
    if not 0 <= user_metrics <= MAX_USER_METRICS:
        raise ValueError(f"user_metrics={user_metrics}: from 0 to {MAX_USER_METRICS}")
    if not 0 <= sample_ids <= MAX_SAMPLE_IDS:
        raise ValueError(f"sample_ids={sample_ids}: from 0 to {MAX_SAMPLE_IDS}")
    if per_rank:
        ranks_per_node = 1
    nodes = math.ceil(ranks / ranks_per_node)
    period = 1.0 / steps_per_s
    steps = max(1, int(duration_s * steps_per_s))
    run = run or time.strftime("loadgen-%Y%m%d-%H%M%S")
    result = LoadgenResult(
        ranks=ranks, nodes=nodes, steps=steps, user_metrics=user_metrics, sample_ids=sample_ids
    )
    parts = urlsplit(url)
    pool = [
        _Connection(parts.hostname or "127.0.0.1", parts.port or 80)
        for _ in range(min(connections or nodes, nodes))
    ]
    result.seconds_offered = steps * period
    lateness = asyncio.create_task(_own_lateness(result.own_lag_s))
    try:
        start = time.monotonic() + 0.5
        began = time.perf_counter()
        run_node = _run_agent_node if replay else _run_node
        await asyncio.gather(
            *[
                run_node(
                    _Node(
                        pool[n % len(pool)],
                        result,
                        run=run,
                        world=ranks,
                        ranks=range(n * ranks_per_node, min(ranks, (n + 1) * ranks_per_node)),
                        steps=steps,
                        period_s=period,
                        start=start,
                        slow_rank=slow_rank,
                        on_sent=on_sent,
                        user=user_metrics,
                        per_rank=per_rank,
                        sample_ids=sample_ids,
                    )
                )
                for n in range(nodes)
            ]
        )
        result.seconds = time.perf_counter() - began
    finally:
        lateness.cancel()
        for conn in pool:
            conn.close()
    return result


async def _own_lateness(lags: list[float], every_s: float = 0.1) -> None:
    """How late the load generator's own event loop runs (a timer every ``every_s``):
    on a machine it shares with the collector, its steps go out that much late too."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        lags.append(max(0.0, loop.time() - due))


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (uvicorn[standard] brings it): its
    round trips cost less CPU than asyncio's own loop, and the load generator shares the
    machine with the collector it measures."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_loadgen(**kwargs: Any) -> LoadgenResult:
    factory = _loop_factory()
    if factory is None or sys.version_info < (3, 11):  # asyncio.Runner is 3.11's
        return asyncio.run(run_loadgen_async(**kwargs))
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run_loadgen_async(**kwargs))


def cmd_loadgen(args: Any) -> None:
    result = run_loadgen(
        url=args.url.rstrip("/"),
        ranks=args.ranks,
        ranks_per_node=args.ranks_per_node,
        steps_per_s=args.steps_per_s,
        duration_s=args.duration,
        run=args.run,
        slow_rank=args.slow_rank,
        user_metrics=args.user_metrics,
        per_rank=args.no_relay,
        # --sample-ids N: the parser's (collector/cli/__init__.py); absent there: none
        sample_ids=getattr(args, "sample_ids", 0) or 0,
        replay=getattr(args, "replay", False),
    )
    print(f"trainwarden loadgen: {result.summary()}")
    for error in result.errors:
        print(f"trainwarden loadgen: error: {error}")
    rate = result.rows / result.seconds if result.seconds else 0
    offered = args.ranks * args.steps_per_s
    print(
        f"trainwarden loadgen: sustained {rate / offered:.0%} of the offered {offered:,.0f} rows/s"
    )
