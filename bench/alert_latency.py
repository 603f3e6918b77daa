"""Alert latency: from ingest of an XID to the webhook being called, with and without load.

    python bench/alert_latency.py [--db postgresql+psycopg://postgres@127.0.0.1:5432/test | sqlite]
                                  [--events 200] [--interval 0.2] [--load-ranks 1024]

``trainwarden serve`` on a scratch database (PostgreSQL, or a temporary SQLite file with
``--db sqlite``) evaluates the default rule pack and sends every alert to one ``webhook``
receiver: a local HTTP server in this script that records when each alert arrives.
The script posts XID 79 events one at a time, each on a new rank of one run, so each is a
new FatalXid alert and one firing notification. For each it takes t0 just before the POST,
t_commit when the 200 answer arrives (the record is stored), t_notify when the webhook is
called; and, from the collector's API, when the engine pass that fired the alert started
and when the notifier began sending it, which splits the time into commit, engine wake,
pass and delivery. ``--load-ranks`` (0 for none) runs ``trainwarden loadgen`` on another
run at the same time (1 step/s per rank), and ``/metrics`` gives the mean duration of an
engine pass (``trainwarden_alert_evaluation_seconds``) while the events were posted.
Target (the issue): p95 of ingest -> notifier call <= 1 s for event rules.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from common import DEFAULT_DB, scratch_database, serving

TARGET_P95_S = 1.0
# Only written into runbook and generator links; nothing fetches it.
EXTERNAL_URL = "https://trainwarden.bench.example"


# -- the receiver -----------------------------------------------------------------------


@dataclass
class Webhook:
    """A loopback HTTP server taking Alertmanager-webhook POSTs; first arrival per alert."""

    arrivals: dict[tuple[str, str, str, str], float] = field(default_factory=dict)
    posts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                at = time.time()  # before reading the body: arrival, not parse time
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook.lock:
                    hook.posts += 1
                    for alert in body.get("alerts", []):
                        labels = alert["labels"]
                        key = (
                            labels["alertname"],
                            labels["run"],
                            labels.get("rank", ""),
                            alert["status"],
                        )
                        hook.arrivals.setdefault(key, at)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def fired(self, run: str, rank: int) -> float | None:
        with self.lock:
            return self.arrivals.get(("FatalXid", run, str(rank), "firing"))

    def others(self, run: str) -> int:
        with self.lock:
            return sum(1 for k in self.arrivals if not (k[0] == "FatalXid" and k[1] == run))


# -- the collector ----------------------------------------------------------------------


@contextmanager
def database(db: str) -> Iterator[str]:
    """A SQLAlchemy URL: a scratch PostgreSQL database, or a temporary SQLite file."""
    if db == "sqlite":
        with tempfile.TemporaryDirectory(prefix="tw-bench-") as tmp:
            yield f"sqlite:///{tmp}/trainwarden.db"
    else:
        with scratch_database(db) as (sa_url, _dsn):
            yield sa_url


@contextmanager
def collector(db_url: str, hook: Webhook) -> Iterator[str]:
    """``trainwarden serve`` sending every alert to ``hook`` (serving() passes its environment)."""
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as tmp:
        notify = Path(tmp) / "notify.yaml"
        notify.write_text(
            f"receivers:\n  - {{name: hook, kind: webhook, url: {hook.url}}}\n"
            "routes:\n  - {receivers: [hook]}\n"
        )
        saved = {k: os.environ.get(k) for k in ("TRAINWARDEN_NOTIFY", "TRAINWARDEN_EXTERNAL_URL")}
        os.environ.update(TRAINWARDEN_NOTIFY=str(notify), TRAINWARDEN_EXTERNAL_URL=EXTERNAL_URL)
        try:
            with serving(db_url, log_name="bench-alert-latency") as url:
                yield url
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def pass_seconds(client: httpx.Client) -> tuple[float, int]:
    """(sum, count) of ``trainwarden_alert_evaluation_seconds`` from ``/metrics``."""
    text = client.get("/metrics").text
    found = {
        name: float(value)
        for name, value in re.findall(
            r"^trainwarden_alert_evaluation_seconds_(sum|count) (\S+)$", text, re.M
        )
    }
    return found.get("sum", 0.0), int(found.get("count", 0))


def xid_body(run: str, rank: int, world: int) -> dict[str, Any]:
    now = time.time()
    return {
        "run": run,
        "agent": {
            "rank": rank,
            "world_size": world,
            "local_rank": 0,
            "host": f"xid-node{rank}",
            "node": f"xid-node{rank}",
            "session": uuid.uuid4().hex,
            "started_at": now,
            "heartbeat_s": 3600,  # posts once: not declared dead (RankDead) during the bench
        },
        "steps": [],
        "events": [
            {
                "id": uuid.uuid4().hex,
                "kind": "xid",
                "ts": now,
                "severity": "critical",
                "data": {"code": 79, "name": "GPU has fallen off the bus"},
            }
        ],
    }


# -- one measurement --------------------------------------------------------------------


@dataclass
class Sample:
    rank: int
    t0: float
    t_commit: float | None = None
    t_notify: float | None = None
    fired_at: float | None = None  # start of the engine pass that fired the alert
    sent_at: float | None = None  # the notifier's first attempt began


def post_xids(
    client: httpx.Client, hook: Webhook, run: str, *, events: int, interval: float, tail_s: float
) -> list[Sample]:
    """XID 79 on ranks 0..events-1, one POST at a time every ``interval`` s."""
    samples = []
    start = time.monotonic()
    for rank in range(events):
        if (delay := start + rank * interval - time.monotonic()) > 0:
            time.sleep(delay)
        body = xid_body(run, rank, events)
        sample = Sample(rank, time.time())
        try:
            r = client.post("/api/v1/ingest", json=body)
            if r.status_code == 200:
                sample.t_commit = time.time()
            else:
                print(f"    XID on rank {rank}: HTTP {r.status_code}: {r.text[:200]}")
        except httpx.HTTPError as exc:
            print(f"    XID on rank {rank}: {exc!r}")
        samples.append(sample)
    deadline = time.monotonic() + tail_s
    while time.monotonic() < deadline and any(hook.fired(run, s.rank) is None for s in samples):
        time.sleep(0.1)
    for s in samples:
        s.t_notify = hook.fired(run, s.rank)
    return samples


def engine_times(client: httpx.Client, run: str, samples: list[Sample]) -> None:
    """Fill in ``fired_at`` and ``sent_at`` from the alerts API (deliveries are stored by
    the pass after they happen: call a few seconds after the last notification)."""
    by_rank = {s.rank: s for s in samples}
    alerts = client.get("/api/v1/alerts", params={"run": run, "rule": "FatalXid", "limit": 10_000})
    for a in alerts.json():
        s = by_rank.get(a["rank"])
        if s is None:
            continue
        s.fired_at = a["fired_at"]
        detail = client.get(f"/api/v1/alerts/{a['id']}").json()
        firing = [d["at"] for d in detail.get("deliveries") or [] if d["status"] == "firing"]
        s.sent_at = min(firing) if firing else None


def quantiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    v = sorted(values)
    p = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731  (as bench/ingest.py)
    ms = lambda x: f"{round(x * 1000):5d} ms"  # noqa: E731
    return f"p50 {ms(p(0.5))}, p95 {ms(p(0.95))}, max {ms(v[-1])}"


def measure(db_url: str, args: argparse.Namespace) -> None:
    db = (
        "SQLite (temporary file)"
        if db_url.startswith("sqlite")
        else "PostgreSQL (scratch database)"
    )
    load_txt = (
        f"{args.load_ranks:,} ranks x 1 step/s of background load on another run"
        if args.load_ranks
        else "no background load"
    )
    print(
        f"trainwarden alert latency ({os.cpu_count()} cpus; one collector process; {db} "
        f"on the same machine; default rule pack; one webhook receiver on loopback; {load_txt})",
        flush=True,
    )
    hook = Webhook()
    run, load_run = f"bench-xid-{uuid.uuid4().hex[:6]}", f"bench-load-{uuid.uuid4().hex[:6]}"
    with collector(db_url, hook) as url, httpx.Client(base_url=url, timeout=30) as client:
        load = None
        if args.load_ranks:
            duration = args.warmup + args.events * args.interval + 5
            cmd = [
                sys.executable,
                "-m",
                "trainwarden.collector.cli",
                "loadgen",
                "--url",
                url,
                "--ranks",
                str(args.load_ranks),
                "--ranks-per-node",
                str(args.ranks_per_node),
                "--steps-per-s",
                "1",
                "--duration",
                str(duration),
                "--run",
                load_run,
            ]
            load = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        try:
            time.sleep(args.warmup if load else 0)  # every node sends a few steps first
            sum0, count0 = pass_seconds(client)
            t_start = time.monotonic()
            samples = post_xids(
                client, hook, run, events=args.events, interval=args.interval, tail_s=args.tail
            )
            window = time.monotonic() - t_start
            sum1, count1 = pass_seconds(client)
            load_out = load.communicate(timeout=120)[0] if load is not None else ""
        finally:
            if load is not None and load.poll() is None:
                load.kill()
                load.wait()
        if load is not None and load.returncode:
            raise SystemExit(f"trainwarden loadgen failed ({load.returncode}):\n{load_out}")
        time.sleep(args.interval + 2.5)  # a full pass stores the last deliveries
        engine_times(client, run, samples)
        others = hook.others(run)

    answered = [s for s in samples if s.t_commit is not None]
    if not answered:
        raise SystemExit("no XID was accepted by the collector; see its log in the temp directory")
    got = [s for s in answered if s.t_notify is not None]
    total = [s.t_notify - s.t0 for s in got]  # type: ignore[operator]
    after = [s.t_notify - s.t_commit for s in got]  # type: ignore[operator]
    timed = [s for s in got if s.fired_at is not None and s.sent_at is not None]
    passes = count1 - count0
    pass_mean = (sum1 - sum0) / passes if passes else float("nan")

    print(
        f"XID 79 on {args.events} new ranks, one every {args.interval:g} s: "
        f"{len(answered)} accepted, {len(got)} FatalXid notifications, "
        f"{len(answered) - len(got)} missing after {args.tail:g} s; "
        f"{others} other notifications"
    )
    print(f"  POST sent -> webhook called (t_notify - t0):           {quantiles(total)}")
    print(f"  POST answered -> webhook called (t_notify - t_commit): {quantiles(after)}")
    print("  where the time goes (per alert; pass start and send start from the alerts API):")
    print(
        "    POST sent -> stored, answered (commit wait):        "
        f"{quantiles([s.t_commit - s.t0 for s in got])}"
    )  # type: ignore[operator]
    print(
        "    answered -> engine pass starts (wake; < 0: sooner): "
        f"{quantiles([s.fired_at - s.t_commit for s in timed])}"
    )  # type: ignore[operator]
    print(
        "    pass starts -> notifier sends (pass + hand-off):    "
        f"{quantiles([s.sent_at - s.fired_at for s in timed])}"
    )  # type: ignore[operator]
    print(
        "    notifier sends -> webhook called (delivery):        "
        f"{quantiles([s.t_notify - s.sent_at for s in timed])}"
    )  # type: ignore[operator]
    print(
        f"  engine: {passes} passes in {window:.0f} s, mean pass {pass_mean * 1000:.0f} ms "
        f"(trainwarden_alert_evaluation_seconds _sum/_count over the window)"
    )
    for line in load_out.splitlines():
        if line.startswith("trainwarden loadgen:"):
            print(f"  load: {line.removeprefix('trainwarden loadgen: ')}")
    p95 = sorted(total)[min(len(total) - 1, int(0.95 * len(total)))] if total else float("inf")
    missing = len(answered) - len(got)
    verdict = "met" if p95 <= TARGET_P95_S and not missing else "MISSED"
    print(
        f"  target p95 <= {TARGET_P95_S:g} s (ingest -> notifier call, event rules): "
        f"p95 {p95:.2f} s{f', {missing} missing' if missing else ''}: {verdict}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default=DEFAULT_DB, help="a PostgreSQL URL, or 'sqlite'")
    p.add_argument("--events", type=int, default=200, help="XID events, each on a new rank")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between XID posts")
    p.add_argument("--load-ranks", type=int, default=1024, help="background ranks; 0: none")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--warmup", type=float, default=8.0, help="seconds of load before measuring")
    p.add_argument("--tail", type=float, default=10.0, help="seconds to wait for the last ones")
    args = p.parse_args()
    if args.events < 1 or args.interval < 0 or args.load_ranks < 0:
        p.error("--events must be >= 1, --interval and --load-ranks >= 0")
    with database(args.db) as db_url:
        measure(db_url, args)


if __name__ == "__main__":
    main()
