"""The node relay (``trainwarden relay``) between real agents and a real collector: the
ranks' batches reach the collector merged, each agent gets its own answer (a rollback's
commands included), a bad batch is refused alone, and nothing is lost when the collector
or the relay is away."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainwarden.agent import exporter as exporter_mod
from trainwarden.agent.exporter import CollectorError, HttpTransport
from trainwarden.agent.relay import Relay

from ..helpers import Server, stop_serve, wait_for
from ..net import free_port
from .helpers import (
    STEPS,
    launch,
    post_together,
    relay_batch,
    rolled_back,
    serve_with_rollback,
    stop,
)
from .launch import torchrun


def _relay_process(upstream: str, expect: int, log: Path) -> tuple[subprocess.Popen, str]:
    """``trainwarden relay --port 0`` and the address it says it listens on (its own, never
    another worker's relay on a port chosen and released before)."""
    cmd = [
        sys.executable,
        "-m",
        "trainwarden.collector.cli",
        "relay",
        "--upstream",
        upstream,
        "--port",
        "0",
        "--expect",
        str(expect),
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def said() -> str | None:
        if proc.poll() is not None:
            raise RuntimeError(f"relay exited with {proc.returncode}:\n{log.read_text()}")
        found = re.search(r"trainwarden relay: (http://127\.0\.0\.1:\d+) -> ", log.read_text())
        return found.group(1) if found else None

    url = wait_for(said, 30, "the relay to say where it listens")
    wait_for(lambda: _stats(url), 30, "the relay to listen")
    return proc, url


def _stats(url: str) -> dict[str, Any] | None:
    try:
        return httpx.get(f"{url}/relay/healthz", timeout=2).json()
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_a_rollback_reaches_every_rank_through_the_node_relay(db_url: str, tmp_path: Path) -> None:
    """The rollback drill of test_rollback_drill, its 4 ranks sending through one relay:
    the relay merges their batches and hands each rank the commands the collector
    returns for it (prepare, then commit), within the drill's 2-step bound."""
    world = 4
    server = serve_with_rollback(db_url, tmp_path)
    relay, relay_url = _relay_process(server.url, world, tmp_path / "relay.log")
    run = "relayed"
    procs = launch(
        server,
        run,
        world,
        tmp_path / "ckpt",
        tmp_path,
        env={"TRAINWARDEN_RELAY": relay_url},
    )
    try:
        rolled_back(server, run, world, procs, tmp_path)

        # Every step of every rank arrived, and the ranks' events (sent as extras) did
        # too: each rank's goodbye finished it, and its GPU probe's verdict is on its row.
        series = server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
        assert max(series["step"]) == STEPS - 1 and set(series["n"]) == {world}
        ranks = server.get(f"/api/v1/runs/{run}/ranks").json()
        assert [r["state"] for r in ranks] == ["finished"] * world
        assert all(r["gpu"] and r["gpu"]["state"] for r in ranks), ranks

        stats = _stats(relay_url)
        assert stats is not None
        # Merged: far fewer requests to the collector than the agents sent the relay, and
        # none passed through one by one.
        assert stats["held"] >= world * 20 and stats["merged_requests"] < stats["held"] / 2, stats
        assert (stats["passed_through"], stats["one_by_one"], stats["refused"]) == (0, 0, 0), stats
    finally:
        stop(procs)
        relay.terminate()
        relay.wait(10)
        stop_serve(server)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_bad_batch_is_refused_alone(live_server: Server) -> None:
    """The merged request is refused (422) for one rank's bad row: the relay sends each
    batch on its own, so the other ranks' steps are stored and only the bad one is
    refused, with the collector's own error."""
    run = f"bad-{uuid.uuid4().hex[:6]}"
    bodies = [
        relay_batch(run, 0, 1),
        relay_batch(run, 1, 1, duration_s=-1.0),
        relay_batch(run, 2, 1),
    ]
    with Relay(live_server.url, port=0, window_s=2.0, expect=3) as relay:
        answers = post_together(relay.url, bodies)
        stats = dict(relay.stats)
    assert [a.status_code for a in answers] == [200, 422, 200], [a.text for a in answers]
    assert "duration_s" in answers[1].text
    assert answers[0].json()["accepted_steps"] == 1
    assert (stats["merged_requests"], stats["one_by_one"]) == (1, 1), stats
    ranks = live_server.get(f"/api/v1/runs/{run}/ranks").json()
    assert [(r["rank"], r["last_step"]) for r in ranks] == [(0, 1), (2, 1)]
    series = wait_for(
        lambda: (
            (s := live_server.get(f"/api/v1/runs/{run}/series", metric="loss").json())["step"] and s
        ),
        15,
        "the step rolled up",
    )
    assert series["n"] == [2]  # ranks 0 and 2


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_merged_batches_keep_their_events_and_gpu_samples(live_server: Server) -> None:
    """Events and GPU samples ride as per-rank extras and land on their own rank."""
    run = f"extras-{uuid.uuid4().hex[:6]}"
    now = time.time()
    a = relay_batch(run, 0, 5)
    b = relay_batch(run, 3, 5)
    b["events"] = [{"id": uuid.uuid4().hex, "kind": "note", "ts": now, "step": 5, "data": {"x": 1}}]
    b["gpu"] = [{"ts": now, "gpu_uuid": "GPU-3", "gpu_name": "H100", "temp_c": 71.0}]
    with Relay(live_server.url, port=0, window_s=2.0, expect=2) as relay:
        answers = post_together(relay.url, [a, b])
    assert [x.status_code for x in answers] == [200, 200], [x.text for x in answers]
    assert answers[1].json()["accepted_events"] == 1
    events = live_server.get(f"/api/v1/runs/{run}/events").json()
    assert [(e["kind"], e["rank"]) for e in events if e["kind"] == "note"] == [("note", 3)]
    gpu = live_server.get(f"/api/v1/runs/{run}/gpu").json()
    assert [(g["rank"], g["gpu_uuid"]) for g in gpu] == [(3, "GPU-3")]


def test_the_collector_away_is_a_503_each_agent_retries(tmp_path: Path) -> None:
    with Relay(f"http://127.0.0.1:{free_port()}", port=0, window_s=0.05) as relay:
        (answer,) = post_together(relay.url, [relay_batch("away", 0, 1)])
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "2"
    assert "out of reach" in answer.json()["detail"]
    assert answer.status_code in exporter_mod.RETRYABLE  # the agent keeps the batch


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_agent_goes_around_a_dead_relay(
    live_server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No relay where TRAINWARDEN_RELAY points: the agent sends to the collector itself,
    and tries the relay again later."""
    port = free_port()
    transport = HttpTransport(
        live_server.url, token=None, timeout_s=10, relay=f"http://127.0.0.1:{port}"
    )
    run = f"around-{uuid.uuid4().hex[:6]}"
    try:
        answer = transport.send("/api/v1/ingest", relay_batch(run, 0, 1))
        assert answer["accepted_steps"] == 1
        assert (transport.via_relay, transport.around_relay) == (0, 1)
        transport._relay_down_until = 0.0  # as after RELAY_FIRST_RETRY_S
        with Relay(live_server.url, port=port, window_s=0.05):
            transport.send("/api/v1/ingest", relay_batch(run, 0, 2))
            assert (transport.via_relay, transport.around_relay) == (1, 1)
            with pytest.raises(CollectorError) as refused:  # the collector's refusal, relayed
                transport.send("/api/v1/ingest", {"run": run, "agent": {"rank": 9}})
            assert refused.value.status == 422 and "world_size" in str(refused.value)
            assert (transport.via_relay, transport.around_relay) == (2, 1)
    finally:
        transport.close()
    ranks = live_server.get(f"/api/v1/runs/{run}/ranks").json()
    assert [r["last_step"] for r in ranks] == [2]


@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_agents_go_direct_once_their_relay_stops(live_server: Server) -> None:
    """A relay that stops (local rank 0's process ending, under ``auto``) closes its agents'
    keep-alive connections: their next batch goes to the collector, none is lost."""
    run = f"stops-{uuid.uuid4().hex[:6]}"
    relay = Relay(live_server.url, port=0, window_s=0.05).start()
    transport = HttpTransport(live_server.url, token=None, timeout_s=10, relay=relay.url)
    try:
        transport.send("/api/v1/ingest", relay_batch(run, 0, 1))
        assert relay.stats["held"] == 1
        relay.stop()
        transport.send("/api/v1/ingest", relay_batch(run, 0, 2))  # the same client, its relay gone
        assert (transport.via_relay, transport.around_relay) == (1, 1)
    finally:
        transport.close()
        relay.stop()
    ranks = live_server.get(f"/api/v1/runs/{run}/ranks").json()
    assert [r["last_step"] for r in ranks] == [2]


def test_relay_refuses_bad_settings_clearly() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainwarden.agent.relay", "--upstream", "ftp://x", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ},
    )
    assert result.returncode == 2
    assert "collector url 'ftp://x' is not valid" in result.stderr
    with pytest.raises(ValueError, match="window"):
        Relay("http://127.0.0.1:1", port=0, window_s=0)


AUTO_TRAINER = """
import json, os, sys, time
import torch.distributed as dist
import trainwarden.agent as tw
from trainwarden.agent import core

relay = None if len(sys.argv) > 4 and sys.argv[4] == "default" else "auto"
agent = tw.init(run=sys.argv[2], url=sys.argv[1], relay=relay, flush_interval_s=0.2)
dist.init_process_group("gloo")
dist.barrier()  # local rank 0's relay listens by now
for step in range(80):
    with tw.step(step, tokens=1024) as s:
        time.sleep(0.05)
        s.loss(2.0 + step / 100)
agent.flush(timeout_s=10)
dist.barrier()  # every rank has sent before rank 0's relay stops
transport = agent._exporter._transport
with open(os.path.join(sys.argv[3], f"rank{dist.get_rank()}.json"), "w") as f:  # not stdout:
    json.dump({"rank": dist.get_rank(), "via_relay": transport.via_relay,  # torchrun mixes it
               "around_relay": transport.around_relay, "relay_url": transport.relay_url,
               "mode": agent.config.relay,
               "runs": None if agent._relay is None else agent._relay.url,
               "relay": None if agent._relay is None else dict(agent._relay.stats)}, f)
dist.destroy_process_group()
"""


def _auto_job(script: Path, url: str, run: str, out: Path, *more: str) -> list[str]:
    """AUTO_TRAINER as a torchrun job of 2 ranks (``default``: it leaves ``relay`` unset)."""
    return torchrun(2, str(script), url, run, str(out), *more)


# One database: what is tested is the agents' relay, not the store (the collector tests
# run every query on both; the suite must stay well under 15 minutes).
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_relay_auto_runs_the_nodes_relay_in_local_rank_0(
    live_server: Server, tmp_path: Path
) -> None:
    """``relay="auto"`` under torchrun: local rank 0's agent runs the node's relay and both
    ranks send through it, with no process to start."""
    script = tmp_path / "trainer.py"
    script.write_text(AUTO_TRAINER)
    run = f"auto-{uuid.uuid4().hex[:6]}"
    cmd = _auto_job(script, live_server.url, run, tmp_path)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_RELAY_PORT": str(free_port()),
        "TRAINWARDEN_PROFILE_EVERY": "0",
    }
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert seen[1]["relay"] is None and seen[0]["relay"] is not None  # rank 0's runs it
    # Both send through it: rank 1 perhaps not at first (its agent may send before rank 0's
    # relay listens: it then sends direct for 2 s and tries again), then for good.
    for r in seen:
        assert r["via_relay"] >= 5, seen
    assert seen[0]["around_relay"] == 0, seen
    stats = seen[0]["relay"]
    assert stats["merged_requests"] < stats["held"] and stats["one_by_one"] == 0, stats
    steps = live_server.get(f"/api/v1/runs/{run}/series", metric="loss").json()
    ranks = live_server.get(f"/api/v1/runs/{run}/ranks").json()
    assert [r["last_step"] for r in ranks] == [79, 79] and [r["state"] for r in ranks] == [
        "finished"
    ] * 2
    assert steps["step"][:1] == [0]


# One database: what is tested is the agents' relay, not the store (the collector tests
# run every query on both; the suite must stay well under 15 minutes).
@pytest.mark.parametrize("db_url", ["postgres"], indirect=True)
def test_two_jobs_on_a_node_each_get_their_own_relay_by_default(
    live_server: Server, tmp_path: Path
) -> None:
    """Two torchrun jobs of 2 ranks on this machine at once, nothing set but the
    collector's URL: each job's local rank 0 runs a relay (``relay="auto"`` is the
    default under a launcher that says a node runs several ranks), on a port of its own
    job's, and each job's ranks send through their own job's relay only."""
    script = tmp_path / "trainer.py"
    script.write_text(AUTO_TRAINER)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_RELAY")},
        "OMP_NUM_THREADS": "1",
        "TRAINWARDEN_PROFILE_EVERY": "0",
    }
    jobs = []
    for job in ("a", "b"):
        out = tmp_path / job
        out.mkdir()
        cmd = _auto_job(
            script, live_server.url, f"two-{job}-{uuid.uuid4().hex[:6]}", out, "default"
        )
        jobs.append(
            (out, subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        )
    relays = []
    for out, proc in jobs:
        printed, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, printed.decode()[-3000:]
        seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert [r["mode"] for r in seen] == ["auto", "auto"], seen
        assert seen[0]["runs"] is not None and seen[1]["runs"] is None, seen
        # Both ranks of the job send through the relay its rank 0 runs, and only it.
        assert [r["relay_url"] for r in seen] == [seen[0]["runs"]] * 2, seen
        assert all(r["via_relay"] >= 5 for r in seen), seen
        stats = seen[0]["relay"]
        assert stats["merged_requests"] < stats["held"] and stats["one_by_one"] == 0, stats
        relays.append(seen[0]["runs"])
    assert relays[0] != relays[1], relays
