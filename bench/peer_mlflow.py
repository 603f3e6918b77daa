"""The peer for bench/ingest.py's (c): MLflow's tracking server taking the same metric points.

    bench/install_mlflow.sh       # once: MLflow in bench/.mlflow-venv (its pins clash with ours)
    python bench/peer_mlflow.py [--db postgresql+psycopg://postgres@127.0.0.1:5432/test]
                                [--ranks 64] [--duration 20] [--workers 8] [--concurrency 8]

``mlflow server`` runs on a scratch database of the same PostgreSQL as its backend store,
with one MLflow run per simulated rank (how per-rank metrics are logged in MLflow). Clients
post the load generator's metrics (one point per metric per rank per step, with step
numbers and timestamps) through ``POST /api/2.0/mlflow/runs/log-batch`` as fast as the
server takes them, many requests in flight. MLflow gets its best case: each request
carries as many whole steps of a rank as its limit of 1000 metrics per request allows
(what MLflow's own asynchronous logging does), so per-request overhead is spread thin.

The executable is found in ``$TRAINWARDEN_BENCH_MLFLOW``, on PATH, or in bench/.mlflow-venv.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
from common import DEFAULT_DB, scratch_database
from sqlalchemy.engine import make_url

from trainwarden.collector.cli.loadgen_bodies import METRIC_COLUMNS, node_body

HERE = Path(__file__).resolve().parent
INSTALL_HINT = "bench/install_mlflow.sh installs it into bench/.mlflow-venv"
MAX_METRICS_PER_REQUEST = 1000  # MLflow's log-batch limit
API = "/api/2.0/mlflow"


def find_mlflow() -> tuple[str | None, str]:
    """(path of the ``mlflow`` executable, how it was found) or (None, why there is none)."""
    configured = os.environ.get("TRAINWARDEN_BENCH_MLFLOW")
    if configured:
        if os.access(configured, os.X_OK):
            return configured, "$TRAINWARDEN_BENCH_MLFLOW"
        return None, f"$TRAINWARDEN_BENCH_MLFLOW={configured} is not an executable; {INSTALL_HINT}"
    on_path = shutil.which("mlflow")
    if on_path:
        return on_path, "PATH"
    local = HERE / ".mlflow-venv" / "bin" / "mlflow"
    if os.access(local, os.X_OK):
        return str(local), "bench/.mlflow-venv"
    return (
        None,
        "no mlflow executable ($TRAINWARDEN_BENCH_MLFLOW, PATH, bench/.mlflow-venv); "
        f"{INSTALL_HINT}",
    )


def mlflow_version(executable: str) -> str:
    out = subprocess.run([executable, "--version"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().rsplit(" ", 1)[-1] or "?"


@contextmanager
def mlflow_server(executable: str, dsn: str, *, workers: int) -> Iterator[str]:
    """``mlflow server`` with ``dsn`` as its backend store on a free loopback port.

    Yields its URL.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    artifacts = tempfile.mkdtemp(prefix="tw-bench-mlflow-")
    log = open(os.path.join(tempfile.gettempdir(), "trainwarden-bench-mlflow.log"), "w")  # noqa: SIM115
    cmd = [
        executable,
        "server",
        "--backend-store-uri",
        dsn,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--default-artifact-root",
        artifacts,
        "--no-serve-artifacts",
    ]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    # Its own process group: uvicorn's workers go down with it.
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180  # the first start migrates the empty database
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {server.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not start; see {log.name}")
            time.sleep(0.3)
        yield url
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)
        log.close()
        shutil.rmtree(artifacts, ignore_errors=True)


def rank_points(
    *, rank: int, world: int, steps: range, metrics: tuple[str, ...], rng: random.Random
) -> list[dict[str, Any]]:
    """The load generator's values for one rank over ``steps``, as MLflow metrics."""
    points: list[dict[str, Any]] = []
    for step in steps:
        cols = node_body(
            run="",
            world=world,
            ranks=range(rank, rank + 1),
            step=step,
            period_s=1.0,
            sessions={rank: ""},
            rng=rng,
            slow_rank=None,
        )["steps"]
        ts_ms = int(cols["ts"][0] * 1000)
        points += [
            {"key": m, "value": float(cols[m][0]), "timestamp": ts_ms, "step": step}
            for m in metrics
        ]
    return points


async def _drive(
    url: str,
    *,
    ranks: int,
    metrics: tuple[str, ...],
    duration_s: float,
    concurrency: int,
    steps_per_request: int,
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    json = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
            r = await client.post(API + path, content=orjson.dumps(body), headers=json)
            r.raise_for_status()
            return r.json()

        exp = await call(
            "/experiments/create", {"name": f"tw-bench-{os.getpid()}-{time.time():.0f}"}
        )
        experiment_id = exp["experiment_id"]
        gate = asyncio.Semaphore(concurrency)

        async def create(rank: int) -> str:
            async with gate:
                run = await call(
                    "/runs/create",
                    {
                        "experiment_id": experiment_id,
                        "run_name": f"rank-{rank}",
                        "start_time": int(time.time() * 1000),
                    },
                )
                return run["run"]["info"]["run_id"]

        run_ids = await asyncio.gather(*[create(r) for r in range(ranks)])
        latencies: list[float] = []
        errors: list[str] = []
        counts = {"ok": 0, "failed": 0, "points": 0}

        async def rank_loop(rank: int, run_id: str) -> None:
            rng = random.Random(rank)
            step = 0
            while time.monotonic() < stop_at:
                async with gate:
                    if time.monotonic() >= stop_at:
                        return
                    points = rank_points(
                        rank=rank,
                        world=ranks,
                        steps=range(step, step + steps_per_request),
                        metrics=metrics,
                        rng=rng,
                    )
                    body = orjson.dumps({"run_id": run_id, "metrics": points})
                    sent = time.perf_counter()
                    try:
                        r = await client.post(API + "/runs/log-batch", content=body, headers=json)
                        ok = r.status_code == 200
                        if not ok and len(errors) < 5:
                            errors.append(f"{r.status_code}: {r.text[:200]}")
                    except httpx.HTTPError as exc:
                        ok = False
                        if len(errors) < 5:
                            errors.append(repr(exc))
                    latencies.append(time.perf_counter() - sent)
                if ok:
                    counts["ok"] += 1
                    counts["points"] += len(points)
                    step += steps_per_request
                else:
                    counts["failed"] += 1

        began = time.perf_counter()
        stop_at = time.monotonic() + duration_s
        await asyncio.gather(*[rank_loop(r, run_id) for r, run_id in enumerate(run_ids)])
        seconds = time.perf_counter() - began
    lat = sorted(latencies) or [float("nan")]
    return {
        "points": counts["points"],
        "seconds": seconds,
        "points_per_s": counts["points"] / seconds,
        "requests_ok": counts["ok"],
        "requests_failed": counts["failed"],
        "errors": errors,
        "request_p50_s": lat[len(lat) // 2],
        "request_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
    }


def mlflow_points_per_s(
    db_url: str,
    *,
    ranks: int,
    metrics: tuple[str, ...] = METRIC_COLUMNS,
    duration_s: float = 20.0,
    workers: int = 8,
    concurrency: int = 8,
    steps_per_request: int | None = None,
) -> dict[str, Any] | None:
    """Points/s MLflow's tracking server sustains through log-batch; None without MLflow.

    ``db_url`` names the PostgreSQL server (any database on it): the peer works in a scratch
    database of its own, dropped afterwards. ``find_mlflow`` says why MLflow is absent.
    The result also has request p50/p95, failed requests and the first errors, the points
    found stored afterwards, and the configuration.
    """
    executable, _how = find_mlflow()
    if executable is None:
        return None
    per_request = steps_per_request or max(1, MAX_METRICS_PER_REQUEST // len(metrics))
    if per_request * len(metrics) > MAX_METRICS_PER_REQUEST:
        raise ValueError(
            f"{per_request} steps x {len(metrics)} metrics exceed MLflow's 1000 per request"
        )
    with scratch_database(db_url) as (_sa_url, dsn):
        # The driver named: SQLAlchemy 2.1 would pick psycopg 3, which MLflow's venv lacks.
        store = (
            make_url(dsn)
            .set(drivername="postgresql+psycopg2")
            .render_as_string(hide_password=False)
        )
        with mlflow_server(executable, store, workers=workers) as url:
            result = asyncio.run(
                _drive(
                    url,
                    ranks=ranks,
                    metrics=metrics,
                    duration_s=duration_s,
                    concurrency=concurrency,
                    steps_per_request=per_request,
                )
            )
        with psycopg.connect(dsn) as conn:
            result["points_stored"] = conn.execute("SELECT count(*) FROM metrics").fetchone()[0]
    result.update(
        version=mlflow_version(executable),
        ranks=ranks,
        metrics=len(metrics),
        workers=workers,
        concurrency=concurrency,
        points_per_request=per_request * len(metrics),
    )
    return result


def describe(r: dict[str, Any]) -> str:
    """One line of configuration and latency for a result of ``mlflow_points_per_s``."""
    return (
        f"MLflow {r['version']}, {r['workers']} server workers, {r['ranks']} runs (one per rank), "
        f"{r['concurrency']} requests in flight of {r['points_per_request']} points; request p50 "
        f"{r['request_p50_s'] * 1000:.0f} ms, p95 {r['request_p95_s'] * 1000:.0f} ms; "
        f"{r['requests_failed']} failed; {r['points_stored']:,} points stored"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=DEFAULT_DB)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--duration", type=float, default=20)
    p.add_argument("--workers", type=int, default=8, help="mlflow server --workers")
    p.add_argument("--concurrency", type=int, default=8, help="log-batch requests in flight")
    p.add_argument(
        "--steps-per-request",
        type=int,
        default=None,
        help="whole steps of one rank per request (default: as many as 1000 metrics allow)",
    )
    args = p.parse_args()
    result = mlflow_points_per_s(
        args.db,
        ranks=args.ranks,
        duration_s=args.duration,
        workers=args.workers,
        concurrency=args.concurrency,
        steps_per_request=args.steps_per_request,
    )
    if result is None:
        print(f"MLflow peer skipped: {find_mlflow()[1]}")
        return
    print(
        f"MLflow log-batch: {result['points_per_s']:,.0f} points/s "
        f"({result['points']:,} points in {result['seconds']:.1f} s)"
    )
    print(f"    {describe(result)}")
    for error in result["errors"]:
        print(f"    error: {error}")


if __name__ == "__main__":
    main()
