"""Ingest throughput against the limit, measured in one run on one PostgreSQL.

    python bench/ingest.py [--db postgresql+psycopg://postgres@127.0.0.1:5432/test]
                           [--ranks 1024] [--ranks-per-node 8] [--duration 30]
                           [--user-metrics 6] [--after-crash] [--no-relay]
                           [--sample-ids 512 [--rounds 1]] [--replay]

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

``--replay``: (b)'s load generator keeps a refused request (503 past capacity) and sends
it again after the answer's Retry-After, with its node's newer ones after it, as agents'
spools do, and drains what is left after the last step. (b) then prints the rows/s taken
while the load was offered, p95 from a step's end to the collector's 200 for the requests
taken at the first try (rows are queryable once answered: the answer follows the commit),
how late the replayed ones were, and the run's rows in the database against those offered.

``--sample-ids N``: what sample ids cost the collector (issue 35). (b) runs twice in the
same invocation, back to back: without ids, and with N ids a row (each rank's step
carrying ``samples_digest``, ``samples_count``, ``samples_epoch`` and the ids in
``samples_kept``, as an agent sends them with a dataset size: collector/cli/loadgen_bodies.py's
``sample_columns``). Each phase has a scratch database and a ``trainwarden serve`` of its
own on the same PostgreSQL (on one, the first phase's ranks would go dead 4.5 s after it
stops, and their alerts would be billed to the second). ``--rounds K`` repeats the pair,
in the order without/with, with/without, ... (drift on a shared machine falls on both).
Prints each phase's lines, then the collector's and PostgreSQL's CPU a stored row with
vs without ids (and the difference a row), rows/s, p95 step -> queryable, the
group-commit writer's flushes (the collector's ``/metrics``) and what ``sample_digests``
holds. A row's CPU includes its share of the collector's work a second (alert passes,
rollups), smaller the more rows a second: compare with vs without at one ``--ranks``.
(c) MLflow is left out under ``--sample-ids``. PostgreSQL's CPU is given twice: that of
the phase's database (its backends and autovacuum) and the server's shared processes
(WAL writer, checkpointer, ...), and that of all the machine's PostgreSQL processes
(other work on the same server adds to it, and a backend of other work that exits
during a phase takes its CPU away from it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg
from common import (
    DEFAULT_DB,
    cpu_seconds,
    postgres_cpu_seconds,
    scratch_database,
    serving_process,
    tree_cpu_seconds,
)
from peer_mlflow import describe, find_mlflow, mlflow_points_per_s
from sqlalchemy import text

from trainwarden.collector.cli.loadgen import run_loadgen
from trainwarden.collector.cli.loadgen_bodies import METRIC_COLUMNS, user_metrics
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
    sample_ids: int = 0,
    pg_dsn: str | None = None,
    statements: bool = False,
    replay: bool = False,
) -> dict[str, Any]:
    """``replay``: the load generator sends a refused request again after Retry-After,
    as agents' spools do (:func:`run_loadgen`); rows/s is then what was taken while the
    load was offered, and the stored rows are counted in the database. ``pg_dsn``: the
    database's libpq DSN, to measure also the CPU of its own PostgreSQL
    backends and of the server's shared background processes (``pg_cpu_us_per_row``);
    with ``statements``, also where its time went, by statement (``pg_stat_statements``)."""
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
        cpu = (tree_cpu_seconds(serve.pid), postgres_cpu_seconds(), _own_cpu_seconds())
        pg_before = _postgres_cpu_by_pid(pg_dsn) if pg_dsn else {}
        if statements and pg_dsn:
            _reset_statements(pg_dsn)
        flushes_before = _writer_sums(url)
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
            sample_ids=sample_ids,
            replay=replay,
        )
        used = [
            b - a
            for a, b in zip(
                cpu,
                (tree_cpu_seconds(serve.pid), postgres_cpu_seconds(), _own_cpu_seconds()),
                strict=True,
            )
        ]
        pg_after = _postgres_cpu_by_pid(pg_dsn) if pg_dsn else {}
        by_statement = _statements(pg_dsn) if statements and pg_dsn else []
        flushes = {k: v - flushes_before.get(k, 0.0) for k, v in _writer_sums(url).items()}
        time.sleep(3)
        stop.set()
        poller.join()
        senders = ranks if per_rank else nodes
        delays = sorted(
            seen[s] - max(sent[s]) for s in seen if s in sent and len(sent[s]) == senders
        )
        p95 = delays[min(len(delays) - 1, int(0.95 * len(delays)))] if delays else float("nan")
        seconds = result.seconds_offered if replay else result.seconds
        rows = result.rows_in_window if replay else result.rows
        return {
            "points_per_s": rows * result.metrics_per_row / seconds,
            "rows_per_s": rows / seconds,
            "offered_rows_per_s": float(ranks),
            "failed": float(result.requests_failed),
            "p95_queryable_s": p95,
            "steps_measured": float(len(delays)),
            "request_p95_s": sorted(result.latencies_s)[int(0.95 * len(result.latencies_s))],
            "request_p50_s": sorted(result.latencies_s)[len(result.latencies_s) // 2],
            "writer": flushes,
            "threads_us_per_row": {
                k.removeprefix("thread:"): v / max(1, result.rows) * 1e6
                for k, v in flushes.items()
                if k.startswith("thread:")
            },
            "main_us_per_request": flushes.get("thread:main", 0.0)
            / max(1.0, flushes.get("trainwarden_ingest_seconds_count", 0.0))
            * 1e6,
            "cpu_us_per_row": [u / max(1, result.rows) * 1e6 for u in used],
            "pg_cpu_us_per_row": sum(t - pg_before.get(pid, 0.0) for pid, t in pg_after.items())
            / max(1, result.rows)
            * 1e6,
            "seconds": result.seconds,
            "rows": result.rows,
            "statements": by_statement,
            "replay": _replay_outcome(db_url, run, result) if replay else None,
        }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _replay_outcome(db_url: str, run: str, result: Any) -> dict[str, float]:
    """With the load generator's replay: how fresh the rows taken at once were, how
    late the replayed ones, and whether every row offered was stored once."""
    engine = make_engine(db_url)
    with engine.connect() as conn:
        stored, distinct = conn.execute(
            text(
                "SELECT count(*), count(DISTINCT (s.rank, s.step)) FROM rank_steps s "
                "JOIN runs r ON r.id = s.run_id WHERE r.name = :n"
            ),
            {"n": run},
        ).one()
    engine.dispose()
    return {
        "fresh_p95_s": _quantile(result.fresh_s, 0.95),
        "fresh_p50_s": _quantile(result.fresh_s, 0.5),
        "fresh_n": float(len(result.fresh_s)),
        "replayed_n": float(result.requests_replayed),
        "replayed_p95_s": _quantile(result.replayed_s, 0.95),
        "offered_s": result.seconds_offered,
        "last_taken_s": result.last_taken_s,
        "unsent": float(result.rows_unsent),
        "offered_rows": float(result.ranks * result.steps),
        "stored": float(stored),
        "duplicated": float(stored - distinct),
        "own_lag_p95_s": _quantile(result.own_lag_s, 0.95),
        "own_lag_max_s": max(result.own_lag_s, default=float("nan")),
    }


def _reset_statements(dsn: str) -> None:
    """Start ``pg_stat_statements`` afresh for this database (the server must preload it:
    ``shared_preload_libraries = 'pg_stat_statements'``; a clear error otherwise)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            conn.execute("SELECT pg_stat_statements_reset()")
        except psycopg.Error as exc:
            raise SystemExit(
                f"--statements needs pg_stat_statements on the server of {dsn}: add "
                "shared_preload_libraries = 'pg_stat_statements' to its postgresql.conf "
                f"and restart it ({str(exc).splitlines()[0]})"
            ) from None


def _statements(dsn: str) -> list[tuple[float, int, int, str]]:
    """This database's statements since the reset, the costliest first: (execution ms,
    calls, rows, the statement's text)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            (float(ms), int(calls), int(rows), " ".join(str(query).split()))
            for ms, calls, rows, query in conn.execute(
                "SELECT total_exec_time, calls, rows, query FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "ORDER BY total_exec_time DESC"
            ).fetchall()
        ]


def print_statements(e2e: dict[str, Any], top: int = 15) -> None:
    """Where PostgreSQL's execution time went, a stored row's share of each statement."""
    found = e2e.get("statements") or []
    if not found:
        return
    rows = max(1, e2e["rows"])
    total = sum(ms for ms, *_ in found)
    calls = sum(n for _, n, _, _ in found)
    print(
        f"    PostgreSQL execution time by statement (pg_stat_statements): "
        f"{total * 1e3 / rows:.0f} us a stored row in all, over {calls:,} statements"
    )
    for ms, calls, n, query in found[:top]:
        print(
            f"    {ms * 1e3 / rows:7.1f} us/row {ms / max(1, calls) * 1e3:8.0f} us/call "
            f"{calls:>8,} calls {n:>10,} rows  {query[:110]}"
        )


def _postgres_cpu_by_pid(dsn: str) -> dict[int, float]:
    """CPU seconds so far of each PostgreSQL process of the database of ``dsn`` (its
    backends, its autovacuum workers) and of the server's shared ones (checkpointer, WAL
    writer, ...), by pid: unlike :func:`postgres_cpu_seconds`, blind to other databases'
    backends, and a process that exits between two readings takes nothing away."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
            "AND (datname = current_database() OR datname IS NULL)"
        ).fetchall()
    cpu = {}
    for (pid,) in pids:
        with contextlib.suppress(OSError):  # gone meanwhile
            cpu[pid] = cpu_seconds(pid)
    return cpu


_WRITER_SUMS = (
    "trainwarden_ingest_flush_seconds_count",
    "trainwarden_ingest_flush_seconds_sum",
    "trainwarden_ingest_flush_requests_sum",
    "trainwarden_ingest_seconds_sum",
    "trainwarden_ingest_seconds_count",
)


_THREAD_CPU = 'trainwarden_collector_thread_cpu_seconds_total{thread="'


def _writer_sums(url: str) -> dict[str, float]:
    """The group-commit writer's counters from the collector's ``/metrics``: flushes, their
    seconds and requests, and the seconds from a request queued to its commit; and the
    collector's CPU seconds by thread (``thread:<part>``; one collector process only)."""
    try:
        page = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    sums = {}
    for line in page.splitlines():
        name, _, value = line.partition(" ")
        if name in _WRITER_SUMS:
            sums[name] = float(value)
        elif name.startswith(_THREAD_CPU):
            sums["thread:" + name[len(_THREAD_CPU) : -2]] = float(value)
    return sums


def _own_cpu_seconds() -> float:
    """This process's CPU seconds: the load generator, and the latency probe's thread."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def print_end_to_end(args: argparse.Namespace, e2e: dict[str, Any], label: str) -> None:
    """(b)'s lines: rows/s, p95 step -> queryable, CPU a stored row."""
    shape = (
        "a request a rank: no relay"
        if args.no_relay
        else f"a request of {args.ranks_per_node} ranks, as a relay sends"
    )
    print(
        f"{label}{e2e['rows_per_s']:>12,.0f} rows/s = "
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
    elif e2e.get("replay") is not None:  # steps completed late, past the probe's window
        print(
            f"    p95 step complete -> queryable: not measured, no step had every rank's row "
            f"while the probe watched (the last 20 steps, until 3 s after the last take); "
            f"request p95 {e2e['request_p95_s'] * 1000:.0f} ms"
        )
    else:  # past saturation: the load generator does not send a refused request again
        print(
            f"    p95 step complete -> queryable: not measured, no step had every rank's row "
            f"(the collector did not take {e2e['failed']:.0f} requests (503 when busy), "
            f"which agents send again and the load generator does not without --replay); "
            f"request p95 {e2e['request_p95_s'] * 1000:.0f} ms"
        )
    if (rp := e2e.get("replay")) is not None:
        print(
            f"    replay (refused requests sent again after Retry-After, as agents' spools do): "
            f"{rp['fresh_n']:,.0f} steps of a sender taken at the first try, step done -> "
            f"stored (the collector's 200, after its commit) p50 {rp['fresh_p50_s']:.2f} s, "
            f"p95 {rp['fresh_p95_s']:.2f} s (target <= 2 s); {rp['replayed_n']:,.0f} requests "
            f"refused, or held back behind a refused one, then taken: their steps p95 "
            f"{rp['replayed_p95_s']:.1f} s after done"
        )
        lost = rp["offered_rows"] - rp["stored"] + rp["duplicated"]
        print(
            f"    the last taken {rp['last_taken_s']:.1f} s after the start (load offered for "
            f"{rp['offered_s']:.0f} s); stored {rp['stored']:,.0f} of {rp['offered_rows']:,.0f} "
            f"rows offered, {rp['duplicated']:,.0f} duplicated, {rp['unsent']:,.0f} unsent"
            f"{' (0 lost)' if lost == 0 and not rp['unsent'] else ''}; the load generator's "
            f"own event loop ran late by p95 {rp['own_lag_p95_s']:.2f} s, at most "
            f"{rp['own_lag_max_s']:.2f} s (its steps go out that much late)"
        )
    serve_us, pg_us, load_us = e2e["cpu_us_per_row"]
    cores = (serve_us + pg_us + load_us) * e2e["rows_per_s"] / 1e6
    print(
        f"    CPU a stored row: collector {serve_us:.0f} us, PostgreSQL {pg_us:.0f} us, "
        f"load generator (and the latency probe) {load_us:.0f} us: "
        f"{cores:.2f} of {os.cpu_count()} cores busy; "
        + (
            "the collector's Python runs on one core at a time (its interpreter lock)"
            if os.environ.get("TRAINWARDEN_WORKERS", "1") == "1"
            else "each collector process's Python on one core at a time"
        )
    )
    if threads := e2e.get("threads_us_per_row"):
        parts = sorted(threads.items(), key=lambda kv: -kv[1])
        print(
            f"    the collector by thread (/metrics): main (the event loop: HTTP, parse, validate) "
            f"{e2e['main_us_per_request']:.0f} us a request taken (refused ones included in its "
            f"cost); a stored row: " + ", ".join(f"{name} {us:.0f} us" for name, us in parts)
        )


def with_and_without_ids(args: argparse.Namespace, copy_points_per_s: float) -> None:
    """--sample-ids: (b) without and with ids, each phase on a scratch database and a
    serve of its own; prints each phase, then with vs without."""
    n = args.sample_ids
    arms: dict[int, list[dict[str, Any]]] = {0: [], n: []}
    for r in range(args.rounds):
        for ids in (0, n) if r % 2 == 0 else (n, 0):
            with scratch_database(args.db) as (sa_url, dsn):
                e2e = end_to_end(
                    sa_url,
                    ranks=args.ranks,
                    ranks_per_node=args.ranks_per_node,
                    duration=args.duration,
                    user=args.user_metrics,
                    per_rank=args.no_relay,
                    sample_ids=ids,
                    pg_dsn=dsn,
                )
                stored = _sample_digests(dsn)
            arms[ids].append(e2e)
            label = f"(b) {f'with {n}' if ids else 'without'} ids, round {r + 1}:"
            print_end_to_end(args, e2e, f"{label:<28}")
            print(
                f"    sample_digests: {stored['rows']:,.0f} rows, kept {stored['kept_bytes']:,.0f} "
                f"bytes a row as stored (of {8 * ids:,} packed); the table with its TOAST and "
                f"indexes {stored['table_bytes'] / 2**20:,.1f} MiB; "
                f"(b)/(a) = {e2e['points_per_s'] / copy_points_per_s:.4f}"
            )

    def mean(arm: int, key: str, i: int | None = None) -> float:
        values = [e[key] if i is None else e[key][i] for e in arms[arm]]
        return sum(values) / len(values)

    rounds = f"means of {args.rounds} rounds" if args.rounds > 1 else "one round"
    print(f"(b) with {n} sample ids a row vs without ({rounds}, same invocation):")
    parts = [
        ("collector", "cpu_us_per_row", 0),
        ("PostgreSQL, this database + shared", "pg_cpu_us_per_row", None),
        ("PostgreSQL, all of the machine's", "cpu_us_per_row", 1),
        ("load generator (and probe)", "cpu_us_per_row", 2),
    ]
    for part, key, i in parts:
        off, on = mean(0, key, i), mean(n, key, i)
        ratio = on / off if off > 0 else float("nan")
        print(
            f"    {part + ' CPU a row:':<48}{off:8.1f} us without, {on:8.1f} us with: "
            f"{on - off:+7.1f} us a row ({ratio:.2f}x)"
        )
    off, on = mean(0, "rows_per_s"), mean(n, "rows_per_s")
    print(f"    {'rows/s:':<48}{off:8,.0f} without, {on:8,.0f} with ({on / off:.3f}x)")
    off, on = mean(0, "p95_queryable_s"), mean(n, "p95_queryable_s")
    print(f"    {'p95 step -> queryable:':<48}{off:8.2f} s without, {on:8.2f} s with")

    def writer(arm: int) -> tuple[float, float, float, float]:
        """Flushes a second, their mean ms and requests, mean ms from queued to commit."""
        w = [e["writer"] for e in arms[arm]]
        flushes = sum(x.get("trainwarden_ingest_flush_seconds_count", 0) for x in w)
        queued = sum(x.get("trainwarden_ingest_seconds_count", 0) for x in w)
        seconds = sum(e["seconds"] for e in arms[arm])
        per = lambda k, d: sum(x.get(k, 0) for x in w) / d if d else float("nan")  # noqa: E731
        return (
            flushes / seconds,
            per("trainwarden_ingest_flush_seconds_sum", flushes) * 1000,
            per("trainwarden_ingest_flush_requests_sum", flushes),
            per("trainwarden_ingest_seconds_sum", queued) * 1000,
        )

    for arm in (0, n):
        rate, ms, reqs, wait = writer(arm)
        print(
            f"    {'group commit, ' + ('with ids:' if arm else 'without ids:'):<48}"
            f"{rate:8.1f} flushes/s of {reqs:.1f} requests, {ms:.1f} ms each; "
            f"a request queued to committed {wait:.1f} ms on average"
        )
    for q in ("p50", "p95"):
        off, on = mean(0, f"request_{q}_s"), mean(n, f"request_{q}_s")
        print(f"    {f'request {q}:':<48}{off * 1000:8.0f} ms without, {on * 1000:8.0f} ms with")


def _sample_digests(dsn: str) -> dict[str, float]:
    """What ``sample_digests`` holds after a phase: its rows, the stored size of ``kept`` a
    row (after PostgreSQL's compression), the table's size with its TOAST and indexes."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*), coalesce(avg(pg_column_size(kept)), 0), "
            "pg_total_relation_size('sample_digests') FROM sample_digests"
        ).fetchone()
    rows, kept, size = row if row else (0, 0, 0)
    return {"rows": float(rows), "kept_bytes": float(kept), "table_bytes": float(size)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--duration", type=float, default=30)
    p.add_argument("--copy-rows", type=int, default=200_000)
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="collector processes (serve --workers N); their CPU is added together",
    )
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
    p.add_argument(
        "--sample-ids",
        type=int,
        default=0,
        metavar="N",
        help="run (b) twice, without and with N sample ids a row (digest, count, epoch and "
        "the ids), and print the collector's and PostgreSQL's CPU a row with vs without; "
        "(c) MLflow is left out",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --sample-ids: pairs of phases, in the order without/with, with/without, ...",
    )
    p.add_argument(
        "--statements",
        action="store_true",
        help="print where PostgreSQL's time went during (b), by statement (needs the server "
        "to preload pg_stat_statements)",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="(b)'s load generator sends a refused request again after Retry-After, oldest "
        "first, as agents' spools do: prints the freshness of the rows taken at the first try "
        "and checks every offered row was stored once (for loads past capacity)",
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
    os.environ["TRAINWARDEN_WORKERS"] = str(args.workers)  # the serve processes started below

    with scratch_database(args.db) as (sa_url, dsn):
        copy_rows = raw_copy(dsn, args.copy_rows, args.user_metrics)
        metrics = len(METRIC_COLUMNS) + args.user_metrics
        processes = (
            "one collector process"
            if args.workers == 1
            else f"{args.workers} collector processes (serve --workers)"
        )
        print(
            f"trainwarden ingest benchmark ({os.cpu_count()} cpus; {processes}; "
            f"PostgreSQL on the same machine; {metrics} metrics per row = "
            f"{len(METRIC_COLUMNS)} built-in + "
            f"{args.user_metrics} user metrics)"
        )
        print(
            f"(a) raw binary COPY:        {copy_rows:>12,.0f} rows/s = "
            f"{copy_rows * metrics:>13,.0f} points/s"
        )
        if args.sample_ids:
            with_and_without_ids(args, copy_rows * metrics)
            return
        e2e = end_to_end(
            sa_url,
            ranks=args.ranks,
            ranks_per_node=args.ranks_per_node,
            duration=args.duration,
            user=args.user_metrics,
            after_crash=args.after_crash,
            per_rank=args.no_relay,
            pg_dsn=dsn,
            statements=args.statements,
            replay=args.replay,
        )
        print_end_to_end(args, e2e, "(b) trainwarden over HTTP:  ")
        print_statements(e2e)
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
