"""Chaos run: ranks train while the collector, its database and the network fail.

    python bench/chaos.py [--ranks 8] [--seconds 180] [--cut-s 60] [--json FILE]

Starts a PostgreSQL cluster of its own (so that it can restart it), ``trainwarden
serve`` on it, a TCP proxy in front of the collector (so that it can cut the network),
and RANKS trainer processes (each ``tw.init`` with the agent's defaults: the on-disk
spool, flush every second) that run steps of a fixed amount of CPU work plus a sleep.
Meanwhile it kills the collector with SIGKILL twice (restarting it each time), restarts
PostgreSQL once, and cuts the network for ``--cut-s`` seconds. Then the trainers stop,
flush, and the run is counted: every record the agents recorded (steps, events, GPU
samples) against what the database holds, per rank: lost, duplicated. And the
trainers' own step times while everything was up against while something was down
(the agent must not slow the trainer: target within 2 %).

Prints the figures; ``--json`` also writes them (tests/e2e/test_chaos.py runs a short
version and checks them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg

SERVE = [
    sys.executable,
    "-m",
    "trainwarden.collector.cli",
    "serve",
    "--log-level",
    "warning",
    "--auth",
    "off",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- PostgreSQL that can be restarted ----------------------------------------------------


class Postgres:
    """A throwaway cluster from the local binaries (as root through Debian's
    pg_createcluster, else initdb + pg_ctl), with restart."""

    def __init__(self) -> None:
        versions = (
            sorted(os.listdir("/usr/lib/postgresql"))
            if os.path.isdir("/usr/lib/postgresql")
            else []
        )
        if not versions:
            raise SystemExit(
                "no PostgreSQL binaries in /usr/lib/postgresql (apt-get install postgresql)"
            )
        self.version = versions[-1]
        self.bindir = Path(f"/usr/lib/postgresql/{self.version}/bin")
        self.port = free_port()
        self.datadir = tempfile.mkdtemp(prefix="tw-chaos-pg-")
        os.chmod(self.datadir, 0o755)
        self.cluster = f"twchaos{os.getpid()}"
        self.debian = os.geteuid() == 0 and shutil.which("pg_createcluster") is not None
        if self.debian:
            _run(
                [
                    "pg_createcluster",
                    self.version,
                    self.cluster,
                    "--port",
                    str(self.port),
                    "--datadir",
                    f"{self.datadir}/pg",
                    "--",
                    "--auth-local=trust",
                    "--auth-host=trust",
                ]
            )
        else:
            _run(
                [
                    str(self.bindir / "initdb"),
                    "-D",
                    f"{self.datadir}/pg",
                    "-U",
                    "postgres",
                    "--auth=trust",
                ]
            )
        self.start()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, what: str) -> None:
        if self.debian:
            _run(["pg_ctlcluster", self.version, self.cluster, what])
        else:
            opts = f"-p {self.port} -k {self.datadir} -c listen_addresses=127.0.0.1"
            _run(
                [
                    str(self.bindir / "pg_ctl"),
                    "-D",
                    f"{self.datadir}/pg",
                    "-l",
                    f"{self.datadir}/log",
                    "-w",
                    "-m",
                    "fast",
                    "-o",
                    opts,
                    what,
                ]
            )

    def start(self) -> None:
        self._ctl("start")

    def restart(self) -> None:
        self._ctl("restart")

    def drop(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._ctl("stop")
        if self.debian:
            subprocess.run(["pg_dropcluster", self.version, self.cluster], capture_output=True)
        shutil.rmtree(self.datadir, ignore_errors=True)


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd[:2])} failed: {(result.stderr or result.stdout).strip()[-400:]}"
        )


# -- the collector, killed and restarted on the same port ------------------------------------


class Collector:
    def __init__(self, db_url: str, log_path: Path) -> None:
        self.db_url = db_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_path.open("a")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*SERVE, "--db", self.db_url, "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.log.flush()
        tail = Path(self.log.name).read_text()[-1500:]
        raise RuntimeError(f"trainwarden serve did not start within 60 s:\n{tail}")

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# -- a TCP proxy whose network can be cut -------------------------------------------------


class Proxy:
    """Forwards 127.0.0.1:<port> to the collector. ``cut()`` drops every connection and
    refuses new ones (as a dead link or a firewall would) until ``restore()``."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.up = True
        self.lock = threading.Lock()
        self.open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()  # the collector is down: the agent sees a refused connection
                continue
            with self.lock:
                self.open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()
            with self.lock:
                self.open -= {src, dst}

    def cut(self) -> None:
        self.up = False
        with self.lock:
            for s in list(self.open):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        self.up = True


# -- the trainers -------------------------------------------------------------------------

TRAINER = textwrap.dedent("""
    import json, os, sys, time
    import trainwarden.agent as tw

    rank, out, stop = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    agent = tw.init(run="chaos", url=os.environ["CHAOS_URL"], rank=rank, profile_every=0)
    work, nap = int(os.environ["CHAOS_WORK"]), float(os.environ["CHAOS_NAP_S"])
    steps, step = [], 0
    while not os.path.exists(stop):
        t0 = time.time()
        with tw.step(step) as s:
            x = 0
            for i in range(work):  # the trainer's own CPU work: what an agent could slow down
                x += i * i
            s.loss(4.0 / (1 + step / 100))
        steps.append((t0, time.time() - t0))
        step += 1
        time.sleep(nap)
    tw.shutdown(timeout_s=30)
    json.dump({"rank": rank, "steps": steps, "stats": agent.stats.as_dict()}, open(out, "w"))
""")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--seconds", type=float, default=180, help="how long the trainers run")
    p.add_argument("--cut-s", type=float, default=60, help="how long the network is cut")
    p.add_argument("--work", type=int, default=400_000, help="loop iterations of CPU work a step")
    p.add_argument("--nap-s", type=float, default=0.1, help="sleep between steps")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tw-chaos-"))
    pg = Postgres()
    collector = proxy = None
    procs: list[subprocess.Popen[bytes]] = []
    faults: list[tuple[float, str]] = []
    try:
        collector = Collector(pg.url, tmp / "serve.log")
        proxy = Proxy(collector.port)
        stop = tmp / "stop"
        env = {
            **os.environ,
            "CHAOS_URL": proxy.url,
            "CHAOS_WORK": str(args.work),
            "CHAOS_NAP_S": str(args.nap_s),
            "WORLD_SIZE": str(args.ranks),
            "OMP_NUM_THREADS": "1",
            "TRAINWARDEN_SPOOL_DIR": str(tmp / "spool"),
        }
        for r in range(args.ranks):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", TRAINER, str(r), str(tmp / f"rank{r}.json"), str(stop)],
                    env={**env, "RANK": str(r)},
                )
            )
        t0 = time.time()
        d = args.seconds
        # The plan: (seconds after the previous fault was over, what). On a loaded machine a
        # restart takes longer, and the run with it: every fault happens, in full.
        plan = [
            (0.10 * d, "kill"),
            (0.10 * d, "pg"),
            (0.08 * d, "cut"),
            (args.cut_s, "restore"),
            (0.08 * d, "kill"),
        ]
        windows: list[tuple[float, float, str]] = []  # (start, end, fault): "something is down"
        for delay, what in plan:
            time.sleep(delay)
            now = time.time()
            if what == "kill":
                collector.kill9()
                time.sleep(2.0)
                collector.start()
                windows.append((now, time.time(), "collector killed (SIGKILL) and restarted"))
            elif what == "pg":
                pg.restart()
                windows.append((now, time.time() + 2.0, "PostgreSQL restarted"))
            elif what == "cut":
                proxy.cut()
                cut_at = now
            elif what == "restore":
                proxy.restore()
                windows.append((cut_at, now, f"network cut for {args.cut_s:.0f} s"))
            faults.append((now - t0, what))
            print(
                f"  t={now - t0:6.1f}s  {windows[-1][2] if what != 'cut' else 'network cut'}",
                flush=True,
            )
        time.sleep(max(0.1 * d, t0 + d - time.time()))  # and some calm at the end
        stop.touch()
        for proc in procs:
            proc.wait(120)
        time.sleep(3)  # the collector's last commits
        results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(args.ranks)]
        figures = count(pg.url, results, windows)
        figures["faults"] = [w[2] for w in windows]
        report(figures, args)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        if collector is not None:
            collector.stop()
        pg.drop()
        shutil.rmtree(tmp, ignore_errors=True)


def count(
    db_url: str, results: list[dict[str, Any]], windows: list[tuple[float, float, str]]
) -> dict[str, Any]:
    dsn = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn) as conn:
        (run_id,) = conn.execute("SELECT id FROM runs WHERE name = 'chaos'").fetchone() or (None,)

        def per_rank(sql: str) -> dict[int, int]:
            return dict(conn.execute(sql, (run_id,)).fetchall())

        steps = per_rank("SELECT rank, count(*) FROM rank_steps WHERE run_id = %s GROUP BY rank")
        distinct = per_rank(
            "SELECT rank, count(DISTINCT step) FROM rank_steps WHERE run_id = %s GROUP BY rank"
        )
        # The agents' events; the collector adds its own about the ranks (state changes,
        # restarts, loss divergence, actions).
        events = per_rank(
            "SELECT rank, count(*) FROM events WHERE run_id = %s AND rank IS NOT NULL "
            "AND kind NOT IN "
            "('rank_state', 'restart', 'loss_divergence', 'action', 'action_failed') GROUP BY rank"
        )
        gpu = per_rank("SELECT rank, count(*) FROM gpu_samples WHERE run_id = %s GROUP BY rank")
    ranks = []
    for res in results:
        r, stats = res["rank"], res["stats"]
        stored = steps.get(r, 0) + events.get(r, 0) + gpu.get(r, 0)
        ranks.append(
            {
                "rank": r,
                "steps_run": len(res["steps"]),
                "recorded": stats["recorded"],
                "stored": stored,
                "steps_stored": steps.get(r, 0),
                "duplicated": steps.get(r, 0) - distinct.get(r, 0),
                "spooled": stats["spooled"],
                "replayed": stats["replayed"],
                "dropped": sum(v for k, v in stats.items() if k.startswith("dropped")),
            }
        )
    # Step times with everything up, and while the network was cut (the collector away as
    # the agents see it, the machine otherwise as busy as before). Restarts of the collector
    # and PostgreSQL load the machine itself (serve's start-up takes a core for seconds),
    # which would be blamed on the agent: those steps are left out of the comparison.
    up, down = [], []
    for res in results:
        for start, seconds in res["steps"]:
            hit = [w for w in windows if w[0] <= start <= w[1]]
            if not hit:
                up.append(seconds)
            elif all(w[2].startswith("network cut") for w in hit):
                down.append(seconds)
    return {
        "ranks": ranks,
        "recorded": sum(x["recorded"] for x in ranks),
        "stored": sum(x["stored"] for x in ranks),
        "lost": sum(max(0, x["recorded"] - x["stored"]) for x in ranks),
        "duplicated": sum(x["duplicated"] for x in ranks)
        + sum(max(0, x["stored"] - x["recorded"]) for x in ranks),
        "spooled": sum(x["spooled"] for x in ranks),
        "replayed": sum(x["replayed"] for x in ranks),
        "step_s_up": statistics.median(up) if up else None,
        "step_s_down": statistics.median(down) if down else None,
        "steps_up": len(up),
        "steps_down": len(down),
    }


def report(f: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"chaos: {args.ranks} ranks for {args.seconds:.0f} s ({os.cpu_count()} cpus); "
        f"faults: {'; '.join(f['faults'])}"
    )
    print(
        f"  records recorded by the agents {f['recorded']:,}, stored {f['stored']:,}: "
        f"lost {f['lost']}, duplicated {f['duplicated']} "
        f"({f['spooled']:,} went through the spool, {f['replayed']:,} replayed)"
    )
    if f["step_s_up"] and f["step_s_down"]:
        ratio = f["step_s_down"] / f["step_s_up"]
        print(
            f"  trainer step time, median: {f['step_s_up'] * 1000:.2f} ms with everything up "
            f"({f['steps_up']:,} steps), {f['step_s_down'] * 1000:.2f} ms "
            f"while the network was cut and "
            f"the agents spooled ({f['steps_down']:,} steps): x{ratio:.3f} (target: within 2 %)"
        )


if __name__ == "__main__":
    main()
