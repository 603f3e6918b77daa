"""What checking tokens costs ingest, measured in one run on one PostgreSQL.

    python bench/auth_cost.py [--db postgresql+psycopg://postgres@127.0.0.1:5432/test]
                              [--ranks 1024] [--ranks-per-node 8] [--steps-per-s 4]
                              [--duration 20]

The same load (the load generator: one request per node per step) against
``trainwarden serve --auth off`` and against ``serve`` as shipped (auth required, an
ingest token on every request); prints points/s and the p95 request latency of each, and
their ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from common import DEFAULT_DB, scratch_database, serving

from trainwarden.collector.cli.loadgen import run_loadgen


def measure(db_url: str, *, auth: bool, args: argparse.Namespace) -> tuple[float, float]:
    if auth:
        made = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainwarden.collector.cli",
                "token",
                "create",
                "bench",
                "--scope",
                "ingest",
                "--db",
                db_url,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        os.environ["TRAINWARDEN_TOKEN"] = made.stdout.strip().splitlines()[-1]
    else:
        os.environ.pop("TRAINWARDEN_TOKEN", None)
    with serving(db_url, log_name=f"auth-cost-{auth}", auth=auth) as url:
        result = run_loadgen(
            url=url,
            ranks=args.ranks,
            ranks_per_node=args.ranks_per_node,
            steps_per_s=args.steps_per_s,
            duration_s=args.duration,
        )
    if result.requests_failed:
        raise SystemExit(f"auth={auth}: {result.summary()}; {result.errors[:3]}")
    lat = sorted(result.latencies_s)
    return result.points / result.seconds, lat[int(0.95 * (len(lat) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--steps-per-s", type=float, default=4.0)
    p.add_argument("--duration", type=float, default=20.0)
    args = p.parse_args()
    figures = {}
    for auth in (False, True):
        with scratch_database(args.db) as (db_url, _dsn):
            figures[auth] = measure(db_url, auth=auth, args=args)
    (off_rate, off_p95), (on_rate, on_p95) = figures[False], figures[True]
    print(f"auth off:      {off_rate:10,.0f} points/s  p95 {off_p95 * 1000:7.1f} ms")
    print(f"auth required: {on_rate:10,.0f} points/s  p95 {on_p95 * 1000:7.1f} ms")
    print(
        f"ratio (required / off): throughput {on_rate / off_rate:.2f}x, p95 {on_p95 / off_p95:.2f}x"
    )


if __name__ == "__main__":
    main()
