"""No false suspects: a clean run's replicas agree at every check.

The demo trainer's ranks (DDP over gloo) train for ``--steps`` steps with a replica check
every ``--check-every`` steps against a real ``trainwarden serve``; then the collector's
comparisons (``GET /api/v1/runs/{run}/replicas``) and ``replica_divergence`` events are
counted. Target (issue 34): 2,000 clean steps on 4 ranks, checks every 10: 0 suspects.

    python bench/replica_clean.py                    # 4 ranks, 2,000 steps, every 10
    python bench/replica_clean.py --ranks 2 --steps 500
    python bench/replica_clean.py --probe-every 10   # the determinism probe too
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import serving  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--check-every", type=int, default=10)
    p.add_argument(
        "--probe-every",
        type=int,
        default=0,
        help="also run the determinism probe every N steps (0: off): 0 probe suspects too",
    )
    args = p.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="tw-replica-"))
    run = "replica-clean"
    with serving(f"sqlite:///{logs / 'collector.db'}", log_name="replica-clean") as url:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        started = time.monotonic()
        for rank in range(args.ranks):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(args.ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "TRAINWARDEN_PROFILE_EVERY": "0",
            }
            cmd = [sys.executable, "-m", "trainwarden.agent.demo_trainer", "--run-name", run]
            cmd += ["--url", url, "--steps", str(args.steps), "--batch-size", "16"]
            cmd += ["--replica-check-every", str(args.check_every)]
            cmd += ["--determinism-probe-every", str(args.probe_every)]
            log = (logs / f"rank{rank}.log").open("w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(3600) for p in procs]
        seconds = time.monotonic() - started
        expected = len(range(0, args.steps, args.check_every))
        results: list[dict] = []
        for _ in range(60):  # the last checks' comparison: the next evaluations
            results = httpx.get(f"{url}/api/v1/runs/{run}/replicas", params={"last": 10_000}).json()
            if len(results) >= expected:
                break
            time.sleep(1)
        events = httpx.get(
            f"{url}/api/v1/runs/{run}/events", params={"kind": "replica_divergence"}
        ).json()
    suspects = sorted({r for res in results for r in res["suspects"]})
    probe_suspects = sorted({r for res in results for r in res.get("probe_suspects") or ()})
    probed = [res for res in results if res.get("probes") is not None]
    missing = sum(1 for res in results if res["missing"])
    print(
        f"{args.ranks} ranks, {args.steps} steps in {seconds:.0f} s (exit codes {codes}), a check "
        f"every {args.check_every}: {len(results)} comparisons of {expected} checked steps, "
        f"{sum(r['agree'] for r in results)} agreed, suspects {suspects or 'none'}, "
        f"{len(events)} replica_divergence events, {missing} with a member missing"
        + (
            f"; probes every {args.probe_every}: {len(probed)} steps' probes compared, "
            f"probe suspects {probe_suspects or 'none'}"
            if args.probe_every
            else ""
        )
    )
    expected_probes = len(range(0, args.steps, args.probe_every)) if args.probe_every else 0
    if (
        codes != [0] * args.ranks
        or suspects
        or probe_suspects
        or events
        or len(results) < expected
        or len(probed) < expected_probes
    ):
        sys.exit(1)


if __name__ == "__main__":
    main()
