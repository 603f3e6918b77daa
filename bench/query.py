"""Run-overview query latency for a large run, through the HTTP API.

    python bench/query.py [--db postgresql+psycopg://postgres@127.0.0.1:5432/test]
                          [--ranks 1024] [--steps 10000]

Seeds a scratch PostgreSQL database with a run of RANKS x STEPS (the per-rank rows by
binary COPY, the per-step rollups by the collector's own rollup code), starts
``trainwarden serve`` on it, and times what the run page asks for: the series of the
overview (full history downsampled to 1,000 points, and the newest 5,000 steps) and a
rank x step heatmap. Prints p50 / p95 per query; the target is p95 <= 200 ms.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import httpx
import psycopg
from common import DEFAULT_DB, scratch_database, serving

from trainwarden.collector.rollups.worker import LEVELS
from trainwarden.collector.store.db import make_engine, upgrade
from trainwarden.collector.store.partitions import day_of, ensure_partitions

COLUMNS = [
    "run_id",
    "step",
    "rank",
    "day",
    "ts",
    "recv_ts",
    "duration_s",
    "data_wait_s",
    "tokens",
    "loss",
    "grad_norm",
    "compute_s",
    "exposed_comm_s",
    "mfu",
    "flops",
    "peak_flops",
]
TYPES = [
    "integer",
    "bigint",
    "integer",
    "integer",
    *["double precision"] * 4,
    "bigint",
    *["double precision"] * 7,
]


def seed(sa_url: str, pg_dsn: str, *, ranks: int, steps: int) -> None:
    engine = make_engine(sa_url)
    upgrade(engine)
    rng = random.Random(0)
    now = time.time()
    ensure_partitions(engine, range(day_of(now), day_of(now + steps) + 1))
    t0 = time.perf_counter()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runs (id, name, created_at, updated_at, world_size, status) "
            "VALUES (1, 'big', %s, %s, %s, 'finished')",
            (now, now, ranks),
        )
        with (
            conn.cursor() as cur,
            cur.copy(f"COPY rank_steps ({', '.join(COLUMNS)}) FROM STDIN (FORMAT BINARY)") as copy,
        ):
            copy.set_types(TYPES)
            for step in range(steps):
                for rank in range(ranks):
                    d = 1.0 + rng.random() * 0.05 + (0.3 if rank == 17 else 0.0)
                    copy.write_row(
                        (
                            1,
                            step,
                            rank,
                            day_of(now + step),
                            now + step,
                            now + step,
                            d,
                            0.01,
                            16384,
                            3.0 - step / steps,
                            1.0,
                            d * 0.8,
                            d * 0.2,
                            0.4,
                            4e14,
                            9.894e14,
                        )
                    )
        print(
            f"seeded {ranks * steps:,} per-rank rows in {time.perf_counter() - t0:.0f}s", flush=True
        )
        t0 = time.perf_counter()
        # The rollups, computed here in SQL (the collector's worker would take minutes for
        # 10M rows in Python; only the query path is measured).
        for metric, column in (("loss", "loss"), ("step_time", "duration_s"), ("mfu", "mfu")):
            conn.execute(
                "INSERT INTO step_stats "
                "(run_id, metric, step, ts, n, nonfinite, min, median, max, mean, total) "
                f"SELECT 1, %s, step, min(ts), count(*), 0, min({column}), "
                f"percentile_cont(0.5) WITHIN GROUP (ORDER BY {column}), max({column}), "
                f"avg({column}), "
                f"avg({column}) FROM rank_steps GROUP BY step",
                (metric,),
            )
        for level in LEVELS:  # the per-rank bucket maxima the worker keeps for heatmaps
            conn.execute(
                "INSERT INTO bucket_maxima (run_id, metric, level, bucket, ranks, maxima) "
                f"SELECT 1, 'step_time', {level}, b, array_agg(rank ORDER BY rank), "
                f"array_agg(m ORDER BY rank) FROM (SELECT step / {level} AS b, rank, "
                "max(duration_s) AS m FROM rank_steps GROUP BY 1, 2) AS t GROUP BY b"
            )
        conn.execute("ANALYZE")
    print(
        f"rolled up {steps:,} steps (3 metrics, heatmap buckets) "
        f"in {time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    engine.dispose()


def timed(client: httpx.Client, path: str, params: dict, n: int) -> tuple[float, float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        response = client.get(path, params=params)
        response.raise_for_status()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return statistics.median(samples) * 1000, samples[int(0.95 * (len(samples) - 1))] * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=40)
    args = p.parse_args()
    with scratch_database(args.db) as (sa_url, dsn):
        seed(sa_url, dsn, ranks=args.ranks, steps=args.steps)
        with (
            serving(sa_url, log_name="bench-query") as url,
            httpx.Client(base_url=url, timeout=30) as client,
        ):
            print(
                f"run-overview queries on {args.ranks:,} ranks x {args.steps:,} steps "
                f"({os.cpu_count()} cpus), "
                f"{args.repeat} each; target p95 <= 200 ms"
            )
            queries = [
                (
                    "series loss, full history, points=1000",
                    "/api/v1/runs/big/series",
                    {"metric": "loss", "points": 1000},
                ),
                (
                    "series step_time, newest 5000 steps",
                    "/api/v1/runs/big/series",
                    {"metric": "step_time", "last": 5000},
                ),
                (
                    "series mfu, steps 2000-3000",
                    "/api/v1/runs/big/series",
                    {"metric": "mfu", "from": 2000, "to": 3000},
                ),
                (
                    "heatmap step_time, 200 buckets",
                    "/api/v1/runs/big/heatmap",
                    {"metric": "step_time", "buckets": 200},
                ),
            ]
            heat = client.get(
                "/api/v1/runs/big/heatmap", params={"metric": "step_time", "buckets": 200}
            ).json()
            slow = heat["values"][17] if len(heat["values"]) > 17 else [0]
            assert len(heat["ranks"]) == args.ranks and slow[0] > 1.2, "heatmap is empty or wrong"
            for name, path, params in queries:
                p50, p95 = timed(client, path, params, args.repeat)
                print(f"  {name:<42} p50 {p50:7.1f} ms   p95 {p95:7.1f} ms")


if __name__ == "__main__":
    main()
