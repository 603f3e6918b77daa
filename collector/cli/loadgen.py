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

What the ranks send: ``loadgen_bodies.py``; the simulated nodes and what they count:
``loadgen_nodes.py``; their HTTP connection: ``loadgen_http.py``. Here: the run and the
command.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from trainwarden.collector.cli.loadgen_bodies import MAX_SAMPLE_IDS, MAX_USER_METRICS, USER_METRICS
from trainwarden.collector.cli.loadgen_http import KeepAliveConnection
from trainwarden.collector.cli.loadgen_nodes import (
    LoadgenResult,
    SimulatedNode,
    run_agent_node,
    run_node,
)


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
    (:func:`run_agent_node`: the steps done while a request was out go in the next one; a
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
        KeepAliveConnection(parts.hostname or "127.0.0.1", parts.port or 80)
        for _ in range(min(connections or nodes, nodes))
    ]
    result.seconds_offered = steps * period
    lateness = asyncio.create_task(_own_lateness(result.own_lag_s))
    try:
        start = time.monotonic() + 0.5
        began = time.perf_counter()
        node_loop = run_agent_node if replay else run_node
        await asyncio.gather(
            *[
                node_loop(
                    SimulatedNode(
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
