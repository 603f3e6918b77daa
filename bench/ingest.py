"""Ingest throughput against the limit, measured in one run on one PostgreSQL.

    python bench/ingest.py [--db postgresql+psycopg://postgres@127.0.0.1:5432/test]
                           [--ranks 1024] [--ranks-per-node 8] [--duration 30]
                           [--user-metrics 6] [--after-crash] [--no-relay]

(a) raw binary COPY of the same wide rows into a table with rank_steps' key: the limit
    (the user metrics as one JSONB object a row, as rank_steps keeps them);
(b) trainwarden end to end: ``trainwarden serve`` on a scratch database, fed by the load
    generator (a request a step for each ``--ranks-per-node`` ranks, as a relay sends: 8
    for a relay per 8-GPU node, 64 for one serving 8 such nodes; ``--no-relay``: a request
    a rank, as agents send with no relay); points/s sustained, and p95 from the
    request that completes a step to that step being queryable in the series API;
(c) MLflow's tracking server taking the same points through log-batch, on a scratch database
    of the same PostgreSQL (bench/peer_mlflow.py; bench/install_mlflow.sh installs MLflow).
Prints points/s for each and the ratios.

``--after-crash``: (b) first sends a run of the same size for 15 s that then stops dead,
with no goodbye (a job that crashed whole: a RankDead alert a rank, one incident), waits
75 s, and measures a second run (its restart under a new name) beside it: what a crashed
job costs the collector while the runs still sending are ingested.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import threading
import time
import uuid
from pathlib import Path

import httpx
import psycopg
from common import DEFAULT_DB, cpu_seconds, postgres_cpu_seconds, scratch_database, serving_process
from peer_mlflow import describe, find_mlflow, mlflow_points_per_s
from sqlalchemy import text

from trainwarden.collector.cli.loadgen import METRIC_COLUMNS, run_loadgen, user_metrics
from trainwarden.collector.store.db import make_engine

ROOT = Path(__file__).resolve().parents[1]


def raw_copy(dsn: str, rows: int, user: int) -> float:
    """Rows/s of binary COPY into a wide table keyed (run_id, step, rank), with ``user``
    user metrics a row in a JSONB column."""
    columns = ["run_id", "step", "rank", "ts", "recv_ts", *METRIC_COLUMNS, "metrics"]
    types = [
        "integer",
        "bigint",
        "integer",
        "double precision",
        "double precision",
        *(["double precision"] * len(METRIC_COLUMNS)),
        "jsonb",
    ]
    ranks = 4096
    rng = random.Random(0)
    data = [
        (
            1,
            i // ranks,
            i % ranks,
            1.7e9 + i,
            1.7e9 + i,
            *([0.5] * len(METRIC_COLUMNS)),
            user_metrics(user, step=i // ranks, rng=rng) if user else None,
        )
        for i in range(rows)
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS tw_bench_copy")
        cols = ", ".join(f"{c} {t}" for c, t in zip(columns, types, strict=True))
        conn.execute(
            f"CREATE UNLOGGED TABLE tw_bench_copy ({cols}, PRIMARY KEY (run_id, step, rank))"
        )
        started = time.perf_counter()
        with (
            conn.cursor() as cur,
            cur.copy(
                f"COPY tw_bench_copy ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)"
            ) as copy,
        ):
            copy.set_types(types)
            for row in data:
                copy.write_row(row)
        took = time.perf_counter() - started
        conn.execute("DROP TABLE tw_bench_copy")
    return rows / took


CRASH_RUN_S = 15.0  # --after-crash: how long the crashed run sends, ...
CRASH_WAIT_S = 75.0  # ... and how long it has been silent when the measured run starts


def end_to_end(
    db_url: str,
    *,
    ranks: int,
    ranks_per_node: int,
    duration: float,
    user: int,
    after_crash: bool = False,
    per_rank: bool = False,
) -> dict[str, float]:
    with serving_process(db_url, log_name="bench-ingest") as (url, serve):
        run = f"bench-{uuid.uuid4().hex[:6]}"
        if after_crash:
            crashed = run_loadgen(
                url=url,
                ranks=ranks,
                ranks_per_node=ranks_per_node,
                steps_per_s=1.0,
                duration_s=CRASH_RUN_S,
                run=f"{run}-crashed",
                user_metrics=user,
            )
            time.sleep(CRASH_WAIT_S)
            engine = make_engine(db_url)
            with engine.connect() as conn:
                states = dict(
                    conn.execute(
                        text(
                            "SELECT k.state, count(*) FROM ranks k JOIN runs r ON r.id = k.run_id "
                            "WHERE r.name = :n GROUP BY 1"
                        ),
                        {"n": f"{run}-crashed"},
                    ).all()
                )
                firing = conn.execute(
                    text(
                        "SELECT count(*) FROM alerts a JOIN runs r ON r.id = a.run_id "
                        "WHERE r.name = :n AND a.state = 'firing'"
                    ),
                    {"n": f"{run}-crashed"},
                ).scalar()
            engine.dispose()
            print(
                f"    crashed run: {crashed.rows:,} rows in {CRASH_RUN_S:.0f} s, "
                f"then silent for {CRASH_WAIT_S:.0f} s: "
                f"its ranks {states}, {firing:,} alerts firing"
            )
        nodes = -(-ranks // ranks_per_node)
        sent: dict[int, list[float]] = {}
        seen: dict[int, float] = {}
        stop = threading.Event()

        def on_sent(step: int, at: float) -> None:
            sent.setdefault(step, []).append(at)

        def poll() -> None:  # when does each step become queryable, complete?
            with httpx.Client(base_url=url, timeout=5) as client:
                while not stop.is_set():
                    try:
                        r = client.get(
                            f"/api/v1/runs/{run}/series", params={"metric": "step_time", "last": 20}
                        )
                        if r.status_code == 200:
                            body = r.json()
                            now = time.time()
                            for step, n in zip(body["step"], body["n"], strict=True):
                                if n >= ranks and step not in seen:
                                    seen[step] = now
                    except httpx.HTTPError:
                        pass
                    time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        # CPU a stored row of each part, over the load: they share the machine's cores.
        cpu = (cpu_seconds(serve.pid), postgres_cpu_seconds(), _own_cpu_seconds())
        result = run_loadgen(
            url=url,
            ranks=ranks,
            ranks_per_node=ranks_per_node,
            steps_per_s=1.0,
            duration_s=duration,
            run=run,
            on_sent=on_sent,
            user_metrics=user,
            per_rank=per_rank,
        )
        used = [
            b - a
            for a, b in zip(
                cpu,
                (cpu_seconds(serve.pid), postgres_cpu_seconds(), _own_cpu_seconds()),
                strict=True,
            )
        ]
        time.sleep(3)
        stop.set()
        poller.join()
        senders = ranks if per_rank else nodes
        delays = sorted(
            seen[s] - max(sent[s]) for s in seen if s in sent and len(sent[s]) == senders
        )
        p95 = delays[min(len(delays) - 1, int(0.95 * len(delays)))] if delays else float("nan")
        return {
            "points_per_s": result.points / result.seconds,
            "rows_per_s": result.rows / result.seconds,
            "offered_rows_per_s": float(ranks),
            "failed": float(result.requests_failed),
            "p95_queryable_s": p95,
            "steps_measured": float(len(delays)),
            "request_p95_s": sorted(result.latencies_s)[int(0.95 * len(result.latencies_s))],
            "cpu_us_per_row": [u / max(1, result.rows) * 1e6 for u in used],
            "seconds": result.seconds,
        }


def _own_cpu_seconds() -> float:
    """This process's CPU seconds: the load generator, and the latency probe's thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--duration", type=float, default=30)
    p.add_argument("--copy-rows", type=int, default=200_000)
    p.add_argument(
        "--user-metrics",
        type=int,
        default=6,
        help="user metrics a row besides the 19 built-in ones (default 6: 25 a row)",
    )
    p.add_argument(
        "--after-crash",
        action="store_true",
        help="measure (b) beside a run of the same size that crashed whole 75 s before",
    )
    p.add_argument(
        "--no-relay",
        action="store_true",
        help="(b) with each rank sending its own request, as agents with no node relay do "
        "(default: one request a node of --ranks-per-node ranks, as its relay sends)",
    )
    p.add_argument("--mlflow-duration", type=float, default=30)
    p.add_argument(
        "--mlflow-ranks",
        type=int,
        default=256,
        help="MLflow runs (one per rank) for (c): creating thousands takes minutes, and its "
        "points/s does not grow with them",
    )
    args = p.parse_args()

    with scratch_database(args.db) as (sa_url, dsn):
        copy_rows = raw_copy(dsn, args.copy_rows, args.user_metrics)
        metrics = len(METRIC_COLUMNS) + args.user_metrics
        print(
            f"trainwarden ingest benchmark ({os.cpu_count()} cpus; one collector process; "
            f"PostgreSQL on the same machine; {metrics} metrics per row = "
            f"{len(METRIC_COLUMNS)} built-in + "
            f"{args.user_metrics} user metrics)"
        )
        print(
            f"(a) raw binary COPY:        {copy_rows:>12,.0f} rows/s = "
            f"{copy_rows * metrics:>13,.0f} points/s"
        )
        e2e = end_to_end(
            sa_url,
            ranks=args.ranks,
            ranks_per_node=args.ranks_per_node,
            duration=args.duration,
            user=args.user_metrics,
            after_crash=args.after_crash,
            per_rank=args.no_relay,
        )
        shape = (
            "a request a rank: no relay"
            if args.no_relay
            else f"a request of {args.ranks_per_node} ranks, as a relay sends"
        )
        print(
            f"(b) trainwarden over HTTP:  {e2e['rows_per_s']:>12,.0f} rows/s = "
            f"{e2e['points_per_s']:>13,.0f} points/s "
            f"({args.ranks} ranks x 1 step/s offered = {args.ranks:,} rows/s, {shape}; "
            f"{e2e['failed']:.0f} failed requests)"
        )
        if e2e["steps_measured"]:
            print(
                f"    p95 step complete -> queryable: {e2e['p95_queryable_s']:.2f} s "
                f"over {e2e['steps_measured']:.0f} steps "
                f"(target <= 2 s); request p95 {e2e['request_p95_s'] * 1000:.0f} ms"
            )
        else:  # past saturation: the load generator does not send a refused request again
            print(
                f"    p95 step complete -> queryable: not measured, no step had every rank's row "
                f"(the collector did not take {e2e['failed']:.0f} requests (503 when busy), "
                f"which agents send again and the load generator does not); "
                f"request p95 {e2e['request_p95_s'] * 1000:.0f} ms"
            )
        serve_us, pg_us, load_us = e2e["cpu_us_per_row"]
        cores = (serve_us + pg_us + load_us) * e2e["rows_per_s"] / 1e6
        print(
            f"    CPU a stored row: collector {serve_us:.0f} us, PostgreSQL {pg_us:.0f} us, "
            f"load generator (and the latency probe) {load_us:.0f} us: "
            f"{cores:.2f} of {os.cpu_count()} cores busy; "
            f"the collector's Python runs on one core at a time (its interpreter lock)"
        )
        print(f"    (b)/(a) = {e2e['points_per_s'] / (copy_rows * metrics):.4f}")
        peer = mlflow_points_per_s(
            args.db, ranks=args.mlflow_ranks, duration_s=args.mlflow_duration
        )
        if peer is None:
            print(f"(c) MLflow log-batch peer: skipped: {find_mlflow()[1]}")
        else:
            print(
                # The peer logs the built-in metrics of each row (bench/peer_mlflow.py).
                f"(c) MLflow log-batch:       "
                f"{peer['points_per_s'] / len(METRIC_COLUMNS):>12,.0f} rows/s = "
                f"{peer['points_per_s']:>13,.0f} points/s"
            )
            print(f"    {describe(peer)}")
            ratio = (
                e2e["points_per_s"] / peer["points_per_s"] if peer["points_per_s"] else float("inf")
            )
            print(f"    (b)/(c) = {ratio:.1f} (target >= 50)")


if __name__ == "__main__":
    main()
