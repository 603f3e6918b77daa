"""What ``trainwarden loadgen``'s simulated ranks send: a node's columnar body
(``node_body``, as its relay sends it) or a rank's own batch (``rank_body``), with
plausible values, the trainer's own metrics (``user_metrics``) and, on request, a
shuffling sampler's sample ids (``sample_columns``).
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
import time
from collections.abc import Callable
from typing import Any

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


def rank_body(node: dict[str, Any]) -> dict[str, Any]:
    """A one-rank node body as that rank's agent sends it with no relay (``IngestBatch``)."""
    heads = node["agent_columns"]
    agent = {k: v[0] for k, v in heads.items()} | {"world_size": node["world_size"]}
    steps = {k: v[0] for k, v in node["steps"].items() if k != "rank"}
    return {"run": node["run"], "agent": agent, "steps": [steps], "events": [], "gpu": []}
