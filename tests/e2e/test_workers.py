"""``trainwarden serve --workers 2`` on PostgreSQL, as a user runs it: both processes take
connections on the one port, a worker killed mid-run is replaced and nothing the load
generator sent is lost or stored twice, the background work goes on, and stopping the
collector stops every worker."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from ..helpers import Server, empty_tables, start_serve, stop_serve

RANKS, STEPS = 128, 10  # 16 nodes: each worker holds some of their connections


def pids_answering(server: Server, connections: int = 40) -> set[int]:
    """The processes that answered ``/healthz``, each on a new connection (the kernel
    hashes each to a worker)."""
    return {
        httpx.get(server.url + "/healthz", timeout=10).json()["pid"] for _ in range(connections)
    }


def children(pid: int) -> set[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return {int(p) for p in f.read().split()}


def scraped(server: Server) -> tuple[float, float]:
    """From ``/metrics`` on a new connection: the step records stored and the ingest
    requests answered ok."""
    text_ = httpx.get(server.url + "/metrics", timeout=10).text
    wanted = (
        'trainwarden_ingest_records_total{kind="step"}',
        'trainwarden_ingest_requests_total{outcome="ok"}',
    )
    assert 'trainwarden_runs{status="' in text_  # the database's gauges are there too
    # A worker's threads are not the collector's: that family is one process's only.
    assert "trainwarden_collector_thread_cpu_seconds" not in text_
    samples = [line.rsplit(" ", 1) for line in text_.splitlines() if not line.startswith("#")]
    found = {name: float(value) for name, value in samples}
    return found[wanted[0]], found[wanted[1]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_workers_share_the_port_and_a_killed_one_loses_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    server = start_serve(pg_url, tmp_path / "serve.log", args=("--workers", "2"))
    now: set[int] = set()
    try:
        workers = children(server.proc.pid)
        assert len(workers) == 2, server.log.read_text()
        assert "2 worker processes" in server.log.read_text()
        assert pids_answering(server) == workers  # each takes connections, the parent none

        loadgen = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainwarden.collector.cli",
                "loadgen",
                "--url",
                server.url,
                "--ranks",
                str(RANKS),
                "--ranks-per-node",
                "8",
                "--duration",
                str(STEPS),
                "--run",
                "workers",
                "--replay",  # as agents: what a dead worker did not answer is sent again
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(STEPS / 3)
        # Frozen first, so that the requests its nodes send meanwhile are in flight to it
        # (a node sends each step), then killed.
        victim = min(workers)
        os.kill(victim, signal.SIGSTOP)
        time.sleep(1.5)
        os.kill(victim, signal.SIGKILL)
        out, _ = loadgen.communicate(timeout=180)
        assert loadgen.returncode == 0, out
        # Requests were in flight to the frozen worker (each of its nodes sent one within
        # the 1.5 s, which waited at least 0.5 s); the kill reset them and they went again.
        slowest = re.search(r"max ([\d,]+) ms", out)
        assert slowest and int(slowest.group(1).replace(",", "")) >= 500, out

        # The parent started another worker in the dead one's place, and it takes requests.
        deadline = time.monotonic() + 30
        while len(children(server.proc.pid) - {victim}) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        now = children(server.proc.pid)
        assert victim not in now and len(now) == 2 and len(now & workers) == 1, now
        assert pids_answering(server) == now
        assert (
            "worker 1" in server.log.read_text() and "killed by SIGKILL" in server.log.read_text()
        )

        # Every row once ((run, rank, step) is the key: a count short of all is a loss).
        engine = create_engine(pg_url)
        try:
            with engine.connect() as conn:
                stored = conn.execute(
                    text(
                        "SELECT count(*), count(DISTINCT (rank, step)) FROM rank_steps "
                        "JOIN runs ON runs.id = rank_steps.run_id WHERE runs.name = 'workers'"
                    )
                ).one()
        finally:
            engine.dispose()
        assert tuple(stored) == (RANKS * STEPS, RANKS * STEPS), out

        # /metrics is the collector's, whichever worker answers the scrape: the same sums
        # on every new connection, counting both workers' (and the killed one's) rows.
        scrapes = {scraped(server) for _ in range(12)}
        assert len(scrapes) == 1, scrapes
        ((step_records, ok_requests),) = scrapes
        assert step_records >= RANKS * STEPS, scrapes  # replays may count again, never less
        # Every request the load generator saw taken, counted by the worker that took it
        # (a node behind merges steps into one request: not one a node and step).
        taken = re.search(r"requests ([\d,]+) ok", out)
        assert taken and ok_requests >= int(taken.group(1).replace(",", "")) > 0, (scrapes, out)

        # The rollups went on (one worker at a time leads them): every step, every rank.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            loss = server.get("/api/v1/runs/workers/series", metric="loss").json()
            if len(loss["step"]) == STEPS and set(loss["n"]) == {RANKS}:
                break
            time.sleep(0.5)
        assert loss["step"] == list(range(STEPS)) and set(loss["n"]) == {RANKS}, loss
    finally:
        stop_serve(server)
        empty_tables(pg_url)
    # Stopping the collector stopped its workers.
    deadline = time.monotonic() + 10
    while any(alive(p) for p in now) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in now if alive(p)]


def test_workers_need_postgresql(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainwarden.collector.cli",
            "serve",
            "--db",
            f"sqlite:///{tmp_path / 'tw.db'}",
            "--workers",
            "2",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "--workers 2 needs PostgreSQL" in result.stderr
