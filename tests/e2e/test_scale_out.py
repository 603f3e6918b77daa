"""Two collectors behind HAProxy on one PostgreSQL, with real agents sending through it.

What it proves, on real parts (Debian's HAProxy, two ``trainwarden serve`` processes,
PostgreSQL, agent processes that run ``tw.init`` / ``tw.step``):

1. HAProxy spreads the ranks' requests over both collectors, and every (run, step,
   rank) row is stored exactly once: none duplicated, none missing.
2. One collector at a time leads each kind of background work. The leader is whoever
   holds that work's PostgreSQL advisory lock; it is taken per pass, inside the pass's
   transaction (``store.db.leads``, ``rollups.worker._locked``), so a pass is led by
   one collector and the next may be led by the other. Each collector names itself to
   PostgreSQL (``application_name`` in its database URL), and a thread of the test
   samples ``pg_locks`` joined with ``pg_stat_activity`` every few milliseconds: no
   lock is ever held by two collectors at once, and each one's holder is named.
3. SIGKILL of the collector that last led the rollups, while the ranks send and with a
   request of theirs in flight to it (it is frozen with SIGSTOP until HAProxy has
   handed it one): HAProxy's health checks take it out of the rotation, the agent whose
   request was cut (a 502) spools and resends it, and in the end every step of every
   rank is stored once with no record dropped; the survivor alone leads every kind of
   background work after the kill, and rolls up the steps sent after it, complete
   (every rank in each).

``/metrics`` and the collectors' logs carry no sign of leadership; ``pg_locks`` does.
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from trainwarden.collector.actions import engine as actions_engine
from trainwarden.collector.alerting import engine as alerting_engine
from trainwarden.collector.health import evaluator as health_evaluator
from trainwarden.collector.incidents import store as incidents_store
from trainwarden.collector.rollups import worker as rollups_worker

from ..helpers import Server, empty_tables, start_serve, stop_serve
from ..net import free_port

HAPROXY = Path("/usr/sbin/haproxy")  # Debian's package: apt-get install -y haproxy
WORLD = 3
STEPS = 360  # a rank's steps; ~25 a second each: the run lasts ~15 s
KILL_AFTER = 80  # steps every rank has stored before the kill
STEP_S = 0.04

# The single-leader work and the advisory lock each pass takes (the collector's own keys).
KEYS = {
    rollups_worker.ADVISORY_LOCK_KEY: "rollups",
    health_evaluator.ADVISORY_LOCK_KEY: "health",
    alerting_engine.ADVISORY_LOCK_KEY: "alerts",
    actions_engine.ADVISORY_LOCK_KEY: "actions",
    incidents_store.ADVISORY_LOCK_KEY: "incidents",
}

RANK = textwrap.dedent("""
    import json, os, sys, time
    import trainwarden.agent as tw

    rank, world, steps, step_s, out = (
        int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    )
    agent = tw.init(
        run=os.environ["SCALE_OUT_RUN"], url=os.environ["SCALE_OUT_URL"], rank=rank,
        world_size=world, flush_interval_s=0.2, profile_every=0, relay="off",
    )
    for i in range(steps):
        with tw.step(i) as s:
            time.sleep(step_s)
            s.loss(4.0 / (1 + i / 100))
    tw.shutdown(timeout_s=60)
    json.dump({"rank": rank, "steps": steps, "stats": agent.stats.as_dict()}, open(out, "w"))
""")


def _haproxy_config(port: int, stats_port: int, servers: dict[str, Server]) -> str:
    """A frontend on ``port`` balancing round-robin over the collectors, each checked with
    ``GET /healthz`` every 200 ms and taken out after 2 failures (a dead one is out in
    under a second); a refused connection is retried on the other (``redispatch``)."""
    lines = [
        "global",
        "    maxconn 1024",
        "defaults",
        "    mode http",
        "    timeout connect 1s",
        "    timeout client 30s",
        "    timeout server 30s",
        "    retries 2",
        "    option redispatch",
        "frontend collectors",
        f"    bind 127.0.0.1:{port}",
        "    default_backend collectors",
        "backend collectors",
        "    balance roundrobin",
        "    option httpchk GET /healthz",
        "    default-server inter 200ms fastinter 100ms downinter 500ms fall 2 rise 2",
    ]
    for name, server in servers.items():
        lines.append(f"    server {name} {server.url.removeprefix('http://')} check")
    lines += [
        "listen stats",
        f"    bind 127.0.0.1:{stats_port}",
        "    stats enable",
        "    stats uri /stats",
    ]
    return "\n".join(lines) + "\n"


def _backends(stats_url: str) -> dict[str, dict[str, str]]:
    """HAProxy's view of each collector (its CSV stats): ``status`` (UP, DOWN, ...),
    ``scur`` (requests it holds now), ``hrsp_2xx`` (its 2xx answers)."""
    body = httpx.get(stats_url + ";csv", timeout=5).text.lstrip("# ")
    return {
        row["svname"]: row
        for row in csv.DictReader(io.StringIO(body))
        if row["pxname"] == "collectors" and row["svname"] not in ("FRONTEND", "BACKEND")
    }


def _stored_steps(server: Server) -> float:
    """``trainwarden_ingest_records_total{kind="step"}``: steps this collector stored."""
    for line in server.get("/metrics").text.splitlines():
        if line.startswith('trainwarden_ingest_records_total{kind="step"}'):
            return float(line.split()[-1])
    return 0.0


class LockWatch:
    """Samples ``pg_locks`` every few milliseconds from its own thread: which collector
    (its ``application_name``) holds each single-leader advisory lock of this database.

    ``held``: (monotonic time, work, collector) per sighting; ``doubles``: samples where
    one lock was held by two backends at once (never, if one leads at a time);
    ``errors``: failed samples (the watch reconnects and goes on)."""

    QUERY = """
        SELECT (l.classid::bigint << 32) | l.objid::bigint, a.application_name
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
    """

    def __init__(self, dsn: str) -> None:
        self.held: list[tuple[float, str, str]] = []
        self.doubles: list[list[tuple[str, str]]] = []
        self.samples = 0
        self.errors: list[str] = []
        self._dsn = dsn
        self._conn = self._connect()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lock-watch", daemon=True)
        self._thread.start()

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self._dsn, autocommit=True, application_name="tw-lock-watch")

    def _run(self) -> None:
        while not self._stop.wait(0.004):
            try:
                rows = self._conn.execute(self.QUERY).fetchall()
            except psycopg.Error as exc:
                self.errors.append(str(exc).strip())
                self._stop.wait(0.2)
                self._conn.close()
                self._conn = self._connect()
                continue
            now = time.monotonic()
            self.samples += 1
            seen = [(KEYS[key], app) for key, app in rows if key in KEYS]
            if len({work for work, _ in seen}) < len(seen):
                self.doubles.append(seen)
            self.held += [(now, work, app) for work, app in seen]

    def holders(self, work: str, since: float = 0.0) -> set[str]:
        return {app for at, w, app in list(self.held) if w == work and at >= since}

    def passes(self, work: str) -> dict[str, int]:
        """Sightings of ``work``'s lock per collector (a pass can be seen several times)."""
        seen: dict[str, int] = {}
        for _, w, app in list(self.held):
            if w == work:
                seen[app] = seen.get(app, 0) + 1
        return seen

    def first_seen(self, work: str, app: str, since: float) -> float | None:
        """Seconds after ``since`` that ``app`` was first seen holding ``work``'s lock."""
        return next(
            (at - since for at, w, a in list(self.held) if w == work and a == app and at >= since),
            None,
        )

    def last_holder(self, work: str) -> str | None:
        return next((app for _, w, app in reversed(list(self.held)) if w == work), None)

    def summary(self, since: float) -> str:
        """For messages: the sightings per work and collector, before and after ``since``."""
        return (
            f"{self.samples} samples ({len(self.errors)} failed: {self.errors[-1:]}); "
            + "; ".join(
                f"{w}: {self.passes(w)}, since: {sorted(self.holders(w, since))}"
                for w in KEYS.values()
            )
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._conn.close()


def wait_for(
    predicate: Callable[[], Any], timeout: float, what: str, detail: Callable[[], str] = str
) -> Any:
    """``predicate()`` once it is truthy, polled until ``timeout``; else fail, saying
    ``what`` was waited for and ``detail()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: {detail()}")


def test_two_collectors_behind_haproxy_store_once_lead_once_and_survive_a_kill(
    pg_url: str, tmp_path: Path
) -> None:
    """Three agent processes send a 360-step run through HAProxy to two collectors on
    one PostgreSQL; the collector that last led the rollups is killed (SIGKILL) after
    every rank has stored 80 steps, with a request in flight to it. Every (step, rank)
    row is stored exactly once, no agent dropped a record (the cut request was spooled
    and resent), both collectors stored rows before the kill, no advisory lock
    was ever held by two collectors at once, the survivor alone leads every kind of
    background work after the kill, and every step sent after it is rolled up with all
    three ranks."""
    if not HAPROXY.exists():
        pytest.fail(
            f"HAPROXY MISSING: {HAPROXY} not found. Install it: apt-get install -y haproxy "
            "(scripts/test.sh does)",
            pytrace=False,
        )
    run = f"scale-out-{uuid.uuid4().hex[:8]}"
    url = make_url(pg_url)
    dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
    named = {  # each collector names itself to PostgreSQL: pg_stat_activity says which is which
        name: url.update_query_dict({"application_name": name}).render_as_string(
            hide_password=False
        )
        for name in ("tw-a", "tw-b")
    }
    servers: dict[str, Server] = {}
    haproxy: subprocess.Popen[bytes] | None = None
    ranks: list[subprocess.Popen[bytes]] = []
    watch: LockWatch | None = None
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: their start-up is seconds
            started = {
                name: pool.submit(start_serve, db, tmp_path / f"{name}.log")
                for name, db in named.items()
            }
            for name, future in started.items():
                servers[name] = future.result()
        port, stats_port = free_port(), free_port()
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(_haproxy_config(port, stats_port, servers))
        haproxy = subprocess.Popen(
            [str(HAPROXY), "-f", str(cfg), "-db"],
            stdout=(tmp_path / "haproxy.log").open("w"),
            stderr=subprocess.STDOUT,
        )
        lb, stats_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{stats_port}/stats"

        def both_up() -> bool:
            if haproxy is not None and haproxy.poll() is not None:
                raise AssertionError(f"haproxy exited:\n{(tmp_path / 'haproxy.log').read_text()}")
            try:
                return {b["status"] for b in _backends(stats_url).values()} == {"UP"}
            except httpx.HTTPError:
                return False

        wait_for(both_up, 15, "HAProxy to see both collectors UP")
        assert httpx.get(lb + "/healthz", timeout=5).status_code == 200
        watch = LockWatch(dsn)

        env = {**os.environ, "SCALE_OUT_RUN": run, "SCALE_OUT_URL": lb, "OMP_NUM_THREADS": "1"}
        for r in range(WORLD):
            ranks.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-c",
                        RANK,
                        str(r),
                        str(WORLD),
                        str(STEPS),
                        str(STEP_S),
                        str(tmp_path / f"rank{r}.json"),
                    ],
                    env=env,
                    stdout=(tmp_path / f"rank{r}.log").open("w"),
                    stderr=subprocess.STDOUT,
                )
            )
        engine = create_engine(pg_url)

        def per_rank() -> dict[int, int]:
            with engine.connect() as conn:
                return dict(
                    conn.execute(
                        text(
                            "SELECT s.rank, count(*) FROM rank_steps s JOIN runs r "
                            "ON r.id = s.run_id WHERE r.name = :run GROUP BY s.rank"
                        ),
                        {"run": run},
                    ).all()
                )

        # Mid-run: every rank has stored KILL_AFTER steps, through both collectors, and
        # some collector has been seen leading the rollups.
        def ready_to_kill() -> str | None:
            counts = per_rank()
            if len(counts) < WORLD or min(counts.values()) < KILL_AFTER:
                return None
            if not all(_stored_steps(s) > 0 for s in servers.values()):
                return None
            return watch.last_holder("rollups") if watch else None

        victim = wait_for(
            ready_to_kill,
            40,
            f"every rank to store {KILL_AFTER} steps through both collectors, a rollup leader",
            lambda: (
                f"rows per rank {per_rank()}, stored per collector "
                f"{ {n: _stored_steps(s) for n, s in servers.items()} }, "
                f"locks: {watch.summary(0.0) if watch else None}"
            ),
        )
        assert all(p.poll() is None for p in ranks), "the ranks ended before the kill"
        through = {name: _stored_steps(s) for name, s in servers.items()}
        served = {name: int(b["hrsp_2xx"]) for name, b in _backends(stats_url).items()}
        (survivor,) = set(servers) - {victim}
        with engine.connect() as conn:
            stored_at_kill = conn.execute(
                text(
                    "SELECT max(s.step) FROM rank_steps s JOIN runs r ON r.id = s.run_id "
                    "WHERE r.name = :run"
                ),
                {"run": run},
            ).scalar_one()
        # The kill lands on requests in flight: the victim is frozen (SIGSTOP) until HAProxy
        # has handed it a request it will never answer, then killed. That request's agent
        # gets a 502 from HAProxy and must resend the batch through the survivor.
        doomed = servers[victim].proc
        doomed.send_signal(signal.SIGSTOP)
        wait_for(
            lambda: int(_backends(stats_url)[victim]["scur"]) > 0,
            10,
            f"HAProxy to hand the frozen {victim} a request",
            lambda: str(_backends(stats_url)[victim]),
        )
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        killed_at = time.monotonic()

        wait_for(
            lambda: _backends(stats_url)[victim]["status"].startswith("DOWN"),
            10,
            f"HAProxy to take {victim} out after its SIGKILL",
        )
        for proc in ranks:
            proc.wait(120)
        results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

        # The survivor leads every kind of background work after the kill, alone (the
        # killed one's sessions, and their locks, are gone within a second).
        # A pass holds its lock for milliseconds, every 0.25 s (rollups) to 2 s (alerts,
        # incidents): the watch sees most of them, not all.
        lead_watch = watch
        for work in KEYS.values():

            def led(work: str = work) -> bool:
                return survivor in lead_watch.holders(work, since=killed_at)

            wait_for(
                led,
                30,
                f"{survivor} to lead the {work} after {victim} was killed",
                lambda: lead_watch.summary(killed_at),
            )
            assert lead_watch.holders(work, since=killed_at + 1.0) == {survivor}, work

        # Every step sent after the kill is rolled up with every rank in it, by the survivor.
        late = range(stored_at_kill + 1, STEPS)

        def rollups() -> dict[int, int]:
            with engine.connect() as conn:
                return dict(
                    conn.execute(
                        text(
                            "SELECT t.step, t.n FROM step_stats t JOIN runs r ON r.id = t.run_id "
                            "WHERE r.name = :run AND t.metric = 'loss' AND t.step > :after"
                        ),
                        {"run": run, "after": stored_at_kill},
                    ).all()
                )

        def incomplete() -> dict[int, int | None]:
            n = rollups()
            return {i: n.get(i) for i in late if n.get(i) != WORLD}

        wait_for(
            lambda: not incomplete(),
            20,
            f"the steps after {stored_at_kill} to be rolled up by {survivor}, every rank in each",
            lambda: (
                f"steps not rolled up, or not with {WORLD} ranks (step: ranks): "
                f"{dict(list(incomplete().items())[:20])}"
            ),
        )

        # Exactly once: every (step, rank) of the run, one row each.
        with engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT s.rank, s.step, count(*) FROM rank_steps s JOIN runs r "
                    "ON r.id = s.run_id WHERE r.name = :run GROUP BY s.rank, s.step"
                ),
                {"run": run},
            ).all()
        engine.dispose()
        duplicated = [(rank, step, n) for rank, step, n in rows if n != 1]
        stored = {(rank, step) for rank, step, _ in rows}
        missing = sorted({(r, i) for r in range(WORLD) for i in range(STEPS)} - stored)
        print(
            f"\nkilled {victim} (last rollup leader) at step {stored_at_kill}; stored before the "
            f"kill: {through}; HAProxy 2xx before the kill: {served}; lock samples "
            f"{watch.samples}, holders: "
            + ", ".join(f"{w}={watch.passes(w)}" for w in KEYS.values())
            + "; survivor first seen leading after the kill (s): "
            + ", ".join(
                f"{w}={watch.first_seen(w, survivor, killed_at):.2f}" for w in KEYS.values()
            )
            + "; agents: "
            + "; ".join(
                f"rank {x['rank']} failed {x['stats']['batches_failed']} "
                f"spooled {x['stats']['spooled']} replayed {x['stats']['replayed']}"
                for x in results
            )
        )
        assert (duplicated, missing[:20]) == ([], []), (len(duplicated), len(missing))
        assert len(rows) == WORLD * STEPS
        for x in results:  # nothing was dropped on the way, and each rank ran every step
            assert x["steps"] == STEPS
            dropped = {k: v for k, v in x["stats"].items() if k.startswith("dropped") and v}
            assert dropped == {}, (x["rank"], dropped)
            assert x["stats"]["replayed"] == x["stats"]["spooled"], x  # all resent
        # The request cut by the kill failed at its agent, which resent it (the rows above).
        assert sum(x["stats"]["batches_failed"] for x in results) >= 1
        assert sum(x["stats"]["replayed"] for x in results) >= 1

        # Both collectors took the run's rows before the kill (the balancer spread them).
        assert all(v > 0 for v in through.values()), through
        assert all(v > 0 for v in served.values()), served
        # One leader at a time: no single-leader lock was ever held by two collectors.
        assert watch.samples > 100 and watch.doubles == [], watch.doubles[:5]
        assert watch.holders("rollups") <= set(servers), watch.holders("rollups")
    finally:
        if watch is not None:
            watch.close()
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
        if haproxy is not None:
            haproxy.terminate()
            try:
                haproxy.wait(10)
            except subprocess.TimeoutExpired:
                haproxy.kill()
        for server in servers.values():
            if server.proc.poll() is None:
                stop_serve(server)
        empty_tables(pg_url)
