"""The ingest writer alone: ``store_many`` on flushes of node-shaped requests, no HTTP.

Each flush is one step of ``--ranks`` ranks in requests of 8 (a node relay's shape, built
by the load generator's ``node_body`` and validated as the collector validates them), or
with ``--per-rank`` a request a rank (an agent with no relay: the load generator's
``rank_body``),
written in one transaction as the collector's writer thread does. For each flush: wall
time, the writer's own CPU (its Python, and psycopg's C) and PostgreSQL's CPU, per row;
then the steady flushes' totals against raw binary COPY of as many rows, measured in the
same run (bench/ingest.py's baseline). The writer's Python and PostgreSQL's work take
turns, so its wall time a row is about the two added: what one writer can take at most.

    python bench/writer_alone.py --ranks 16384 --flushes 12
    python bench/writer_alone.py --ranks 1024 --per-rank   # the direct path's flushes
    python bench/writer_alone.py --statements   # also where PostgreSQL's time went

``--statements`` needs a server that preloads pg_stat_statements (bench/results notes how
a second cluster is set up for it).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

import orjson
import psycopg
from common import DEFAULT_DB, postgres_cpu_seconds, scratch_database
from ingest import raw_copy

from trainwarden.collector.cli.loadgen_bodies import node_body, rank_body
from trainwarden.collector.ingest.batches import store_many
from trainwarden.collector.ingest.schema_columns import ColumnarBatch
from trainwarden.collector.ingest.schemas import IngestBatch
from trainwarden.collector.store.db import make_engine, upgrade, write

WARM_FLUSHES = 2  # the first flush inserts the ranks; the next warms the caches


def _flush(
    ranks: int, step: int, sessions: dict[int, str], rng: random.Random, *, per_rank: bool = False
) -> list[Any]:
    size = 1 if per_rank else 8
    bodies = [
        node_body(
            run="writer-alone",
            world=ranks,
            ranks=range(size * i, size * i + size),
            step=step,
            period_s=1.0,
            sessions=sessions,
            rng=rng,
            slow_rank=None,
            user=6,
        )
        for i in range(ranks // size)
    ]
    if per_rank:
        return [
            IngestBatch.model_validate(orjson.loads(orjson.dumps(rank_body(b)))) for b in bodies
        ]
    return [ColumnarBatch.model_validate(orjson.loads(orjson.dumps(b))) for b in bodies]


def _statements(dsn: str, rows: int, top: int = 8) -> None:
    query = (
        "SELECT total_exec_time, calls, rows, query FROM pg_stat_statements "
        "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "ORDER BY 1 DESC LIMIT %s"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        for took_ms, calls, n, sql in conn.execute(query, (top,)):
            print(f"  {took_ms * 1e3 / rows:6.1f} us/row {calls:5d} calls {n:8d} rows  {sql[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default=DEFAULT_DB)
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--flushes", type=int, default=12)
    parser.add_argument("--statements", action="store_true")
    parser.add_argument(
        "--per-rank", action="store_true", help="a request a rank (no relay), not a node's 8"
    )
    args = parser.parse_args()
    if args.flushes <= WARM_FLUSHES or args.ranks < 8 or args.ranks % 8:
        parser.error(
            f"--flushes must be more than {WARM_FLUSHES} (the warm-up ones are not counted) "
            "and --ranks a multiple of 8 (requests of 8 ranks)"
        )
    rng = random.Random(1)
    sessions = {r: f"s{r:06d}" for r in range(args.ranks)}
    wall = cpu = pg = 0.0
    rows = 0
    with scratch_database(args.db) as (url, dsn):
        copy_rows_per_s = raw_copy(dsn, 100_000, 6)
        engine = make_engine(url)
        upgrade(engine)
        for step in range(args.flushes):
            batches = _flush(args.ranks, step, sessions, rng, per_rank=args.per_rank)
            if step == WARM_FLUSHES and args.statements:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                    conn.execute("SELECT pg_stat_statements_reset()")
            w0, c0, p0 = time.perf_counter(), time.thread_time(), postgres_cpu_seconds()
            with write(engine) as conn:
                store_many(conn, batches)
            w = time.perf_counter() - w0
            c, p = time.thread_time() - c0, postgres_cpu_seconds() - p0
            n = args.ranks
            print(
                f"flush {step}: wall {w / n * 1e6:.1f} us a row, the writer's CPU "
                f"{c / n * 1e6:.1f}, PostgreSQL's {p / n * 1e6:.1f}"
            )
            if step >= WARM_FLUSHES:
                wall, cpu, pg, rows = wall + w, cpu + c, pg + p, rows + n
        if args.statements:
            _statements(dsn, rows)
        engine.dispose()
    print(
        f"steady ({os.cpu_count()} cpus): wall {wall / rows * 1e6:.1f} us a row "
        f"({rows / wall:,.0f} rows/s), the writer's CPU {cpu / rows * 1e6:.1f} us, "
        f"PostgreSQL's {pg / rows * 1e6:.1f} us; raw binary COPY {copy_rows_per_s:,.0f} rows/s; "
        f"(writer)/(COPY) = {rows / wall / copy_rows_per_s:.3f}"
    )


if __name__ == "__main__":
    main()
