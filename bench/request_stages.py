"""Where an ingest request's time goes past capacity, stage by stage, on both sides.

``trainwarden loadgen --replay`` (as agents behave: refused requests resent after
Retry-After) against ``bench/request_stages_serve.py`` (``serve`` with a stamp at each
stage) on a scratch PostgreSQL database. Each client request is matched to the server's
record of it (same sender, in order) and the time is split into: sent -> its connection
accepted (for a request that opened one) and -> its first bytes parsed by the server;
headers -> the app called (the server's event-loop queue); the body read -> the
response started (the writer's queue and its commit, for a 200); the response sent ->
the client has it (the load generator's own loop, which shares the machine); and the
total; by outcome, and by whether the request was its connection's first. Also the
server's event-loop lateness.

    python bench/request_stages.py --ranks 36864 --duration 40

Figures: bench/results/ingest-cpu-2vcpu.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DEFAULT_DB, scratch_database, wait_healthy  # noqa: E402
from trainwarden.collector.cli import loadgen, loadgen_nodes  # noqa: E402

CLIENT: list[dict[str, Any]] = []
_post = loadgen_nodes.SimulatedNode.post


async def _post_stamped(self: Any, body: bytes) -> tuple[int, float]:
    sent, fresh = time.time(), self.client.conn is None  # fresh: it opens a connection
    status, answered = await _post(self, body)
    sender = self.sender.split(":", 1)[1].strip()
    CLIENT.append(
        {"sender": sender, "sent": sent, "got": time.time(), "status": status, "new": fresh}
    )
    return status, answered


loadgen_nodes.SimulatedNode.post = _post_stamped  # type: ignore[method-assign]


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")


def matched(server: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(client request, the server's record of it): per sender, in order of time."""
    by_sender: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in server:
        by_sender[rec["sender"]].append(rec)
    pairs = []
    for sender, sent in _group(CLIENT).items():
        records = sorted(by_sender.get(sender, []), key=lambda r: r["app"])
        j = 0
        for c in sorted(sent, key=lambda c: c["sent"]):
            while j < len(records) and (records[j]["t0"] or records[j]["app"]) < c["sent"] - 0.05:
                j += 1
            if j < len(records) and records[j].get("end", 1e20) <= c["got"] + 0.05:
                pairs.append((c, records[j]))
                j += 1
    return pairs


def _group(requests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in requests:
        out[c["sender"]].append(c)
    return out


STAGES = {
    "sent -> connection accepted": ("sent", "opened"),
    "sent -> first bytes parsed": ("sent", "t0"),
    "headers -> app called": ("headers", "app"),
    "body read -> response start": ("body", "start"),
    "response sent -> client has it": ("end", "got"),
    "total (client)": ("sent", "got"),
}


def report(pairs: list[tuple[dict[str, Any], dict[str, Any]]], lags: list[float]) -> None:
    kinds = (
        ("taken (200)", lambda c, s: c["status"] == 200),
        ("refused (503)", lambda c, s: c["status"] == 503),
        ("on a connection the server had open", lambda c, s: (s["nth"] or 0) > 1),
        ("the first on its connection (to the server)", lambda c, s: s["nth"] == 1),
        ("  of which the client opened it for this request", lambda c, s: c["new"]),
    )
    for label, keep in kinds:
        chosen = [{**s, **c} for c, s in pairs if keep(c, s)]
        print(f"  {label}: {len(chosen):,} requests")
        for stage, (a, b) in STAGES.items():
            spans = [
                r[b] - r[a]
                for r in chosen
                if r.get(a) and r.get(b) and (b != "opened" or r.get("nth") == 1)
            ]  # a connection accepted before the request says nothing of it
            print(
                f"    {stage:32s} p50 {pct(spans, 0.5):6.3f} s  p95 {pct(spans, 0.95):6.3f} s  "
                f"p99 {pct(spans, 0.99):6.3f} s  max {max(spans, default=float('nan')):6.3f} s"
            )
    print(
        f"  the server's event loop late: p50 {pct(lags, 0.5):.3f} s, p95 {pct(lags, 0.95):.3f} s, "
        f"max {max(lags, default=0.0):.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=36864)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--db", default=DEFAULT_DB)
    args = parser.parse_args()
    out = os.path.join(tempfile.mkdtemp(), "stages.json")
    with scratch_database(args.db) as (db, _dsn), socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        serve = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("request_stages_serve.py")),
                *("serve", "--db", db, "--port", str(port), "--log-level", "warning"),
                *("--auth", "off"),
            ],
            env={**os.environ, "STAGES_OUT": out},
            stdout=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, "its output (stderr)")
            result = loadgen.run_loadgen(
                url=url,
                ranks=args.ranks,
                ranks_per_node=args.ranks_per_node,
                steps_per_s=1.0,
                duration_s=args.duration,
                replay=True,
            )
            time.sleep(4)  # the server's last dump
        finally:
            serve.terminate()
            serve.wait(30)
    data = json.loads(Path(out).read_text())
    print(
        f"{args.ranks} ranks in requests of {args.ranks_per_node}, {args.duration:.0f} s offered: "
        f"{result.rows:,} rows taken, {result.requests_failed:,} requests refused and resent; "
        f"the load generator's own loop late p95 {pct(result.own_lag_s, 0.95):.2f} s"
    )
    report(matched(data["records"]), [lag for _, lag in data["lags"]])


if __name__ == "__main__":
    main()
