"""What running the node's relay (``relay="auto"``) costs local rank 0's trainer, against the
same trainer with no relay, in the same run.

    python bench/relay_overhead.py [--step-ms 50] [--blocks 8] [--steps-per-block 40] [--peers 7]

A real collector (``trainwarden serve`` on a scratch SQLite file) and, in another process,
``--peers`` simulated local ranks, each posting its rank's batch once a second to the
node's relay port, and straight to the collector when nothing listens there (as an agent
goes around a dead relay). This process is local rank 0: a real training step (an MLP
sized to about ``--step-ms``) under ``tw.step``, its agent restarted each block with the
relay on (``relay="auto"``: it runs the relay, and the peers' batches go through it) or
off (``relay=None``: the peers send to the collector themselves), blocks alternating.
Printed: the median step time of each arm and their ratio, the process's CPU a second in
each (the relay's work is the difference) and what the relay merged.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import torch

import trainwarden.agent as tw
from trainwarden.agent import core
from trainwarden.agent.exporter import flush_phase
from trainwarden.agent.wire import INGEST_PATH

sys.path.insert(0, os.path.dirname(__file__))
from agent_overhead import sized_mlp, train_step  # noqa: E402
from common import serving  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peers(
    relay: str, collector: str, run: str, ranks: list[int], world: int, stop: Any, counts: Any
) -> None:
    """Local ranks 1..N of the node: a batch a second each, on the node's ticks (as agents
    with a relay send), to the relay, else direct."""
    import httpx

    def rank_loop(rank: int) -> None:
        rng = random.Random(rank)
        header = {
            "rank": rank,
            "world_size": world,
            "local_rank": rank,
            "host": "node0",
            "session": uuid.uuid4().hex,
            "heartbeat_s": 2.0,
        }
        via, direct = (
            httpx.Client(base_url=relay, timeout=10),
            httpx.Client(base_url=collector, timeout=10),
        )
        step = 0
        phase = flush_phase("node0", 1.0)  # as the node's agents send: together
        while not stop.wait(1.0 - (time.time() - phase) % 1.0 + rng.random() * 0.005):
            now = time.time()
            body = {
                "run": run,
                "agent": {**header, "sent_at": now, "last_step": step},
                "steps": [
                    {
                        "step": step,
                        "ts": now - 0.9,
                        "duration_s": 0.9,
                        "loss": 2.0 + rng.random(),
                        "tokens": 4096,
                        "compute_s": 0.7,
                        "exposed_comm_s": 0.2,
                    }
                ],
            }
            try:
                via.post(INGEST_PATH, json=body)
                counts[0] += 1
            except httpx.TransportError:
                with contextlib.suppress(httpx.TransportError):
                    direct.post(INGEST_PATH, json=body)
                    counts[1] += 1
            step += 1

    threads = [threading.Thread(target=rank_loop, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--blocks", type=int, default=8, help="blocks of each arm")
    p.add_argument("--steps-per-block", type=int, default=40)
    p.add_argument("--peers", type=int, default=7, help="the node's other local ranks")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, opt, x = sized_mlp(args.step_ms)
    port = free_port()
    os.environ["TRAINWARDEN_RELAY_PORT"] = str(port)
    os.environ["LOCAL_WORLD_SIZE"] = str(args.peers + 1)
    os.environ["NODE_NAME"] = "node0"  # the peers' node: its agents send on the same ticks
    world = args.peers + 1
    run = f"bench-relay-{uuid.uuid4().hex[:6]}"
    db = os.path.join(tempfile.mkdtemp(), "relay.db")
    with serving(f"sqlite:///{db}", log_name="bench-relay") as url:
        ctx = mp.get_context("spawn")
        stop, counts = ctx.Event(), ctx.Array("l", 2)
        peer_proc = ctx.Process(
            target=peers,
            args=(f"http://127.0.0.1:{port}", url, run, list(range(1, world)), world, stop, counts),
        )
        peer_proc.start()
        times: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        held = merged = 0
        step = 0
        try:
            for block in range(args.blocks * 2):
                arm = block % 2 == 1
                agent = tw.init(
                    run=run,
                    url=url,
                    relay="auto" if arm else None,
                    rank=0,
                    world_size=world,
                    local_rank=0,
                    profile_every=0,
                    gpu_interval_s=0,
                )
                wall0, cpu0 = time.perf_counter(), cpu_s()
                for i in range(args.steps_per_block):
                    t0 = time.perf_counter()
                    with tw.step(step, tokens=x.shape[0]) as s:
                        s.loss(train_step(model, opt, x))
                    if i >= 3:  # past the agent's start
                        times[arm].append(time.perf_counter() - t0)
                    step += 1
                cpu[arm].append((cpu_s() - cpu0) / (time.perf_counter() - wall0))
                if agent._relay is not None:
                    held += agent._relay.stats["held"]
                    merged += agent._relay.stats["merged_requests"]
                tw.shutdown()
                assert core._agent is None or core._agent._closed
        finally:
            stop.set()
            peer_proc.join(30)
    off, on = (statistics.median(times[a]) * 1000 for a in (False, True))
    cpu_off, cpu_on = (statistics.median(cpu[a]) for a in (False, True))
    print(
        f"trainwarden relay overhead ({os.cpu_count()} cpus, torch {torch.__version__}): "
        f"local rank 0 of {world}, {args.blocks} blocks of {args.steps_per_block} steps "
        "each arm, alternating"
    )
    print(
        f"   step time: relay off {off:.2f} ms ; relay on (this process runs it) {on:.2f} ms ; "
        f"ratio {on / off:.4f}"
    )
    print(
        f"   this process's CPU: {cpu_off:.3f} cores relay off, {cpu_on:.3f} on: the relay "
        f"{(cpu_on - cpu_off) * 1000:+.1f} ms a second"
    )
    print(
        f"   the peers sent {counts[0]} batches through the relay, "
        f"{counts[1]} straight to the collector"
    )
    print(
        f"   the relay held {held} batches of {world} ranks and sent the collector "
        f"{merged} requests ({held / max(1, merged):.1f} batches a request)"
    )


if __name__ == "__main__":
    main()
