"""A process's rank: from tw.init or ``RANK``, else from its process group once it exists,
else rank 0 of 1 at its first step (agent/placement.py). Nothing goes out under a guessed
rank. The multi-process cases run real gloo groups in spawned processes, each reporting
what its agent sent."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

import trainwarden.agent as tw
from trainwarden.agent import placement
from trainwarden.agent.config import AgentConfig

from ..net import free_port
from .helpers import RecordingTransport

LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in (*LAUNCHER, "SLURM_LOCALID", "TRAINWARDEN_URL", "TRAINWARDEN_RUN"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def headers(transport: RecordingTransport) -> set[tuple[int, int, int]]:
    return {
        (b["agent"]["rank"], b["agent"]["world_size"], b["agent"]["local_rank"])
        for b in transport.bodies
    }


def test_the_config_says_where_the_rank_comes_from(monkeypatch: pytest.MonkeyPatch) -> None:
    assert AgentConfig.resolve(run="r").placement == "pending"
    assert AgentConfig.resolve(run="r", rank=1, world_size=2).placement == "argument"
    # Lightning's launcher sets WORLD_SIZE and LOCAL_RANK but no RANK: still pending, and
    # its WORLD_SIZE is not taken as this rank's world.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    pending = AgentConfig.resolve(run="r")
    assert (pending.placement, pending.world_size) == ("pending", 1)
    monkeypatch.setenv("RANK", "1")
    said = AgentConfig.resolve(run="r")
    assert (said.placement, said.rank, said.world_size, said.local_rank) == ("environment", 1, 2, 1)


def test_a_shutdown_waits_for_a_slow_identity_thread_to_connect_and_sends_what_it_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process without a rank settles it on the agent's identity thread, which then
    makes the exporter. On a busy machine that thread may run late: the shutdown right
    after the last step waits for it (within its budget) and sends the steps, rather than
    returning with nothing sent and an exporter starting behind it (seen in CI)."""
    alone = placement.without_group

    def starved() -> placement.Place:
        time.sleep(2.5)  # the identity thread kept off the CPU; the join below waits 2 s
        return alone()

    monkeypatch.setattr(placement, "without_group", starved)
    transport = RecordingTransport()
    tw.init(run="late", transport=transport, flush_interval_s=0.05)
    with tw.step(0):
        pass
    tw.shutdown(timeout_s=8)
    assert [s["step"] for s in transport.steps()] == [0]
    assert "attempt_end" in [e["kind"] for e in transport.events()]


def test_without_a_rank_nothing_goes_out_until_the_first_step_then_rank_0_of_1() -> None:
    transport = RecordingTransport()
    agent = tw.init(run="alone", transport=transport, flush_interval_s=0.05, heartbeat_s=0.1)
    time.sleep(0.6)  # heartbeats would have gone out six times
    assert transport.bodies == [] and agent.config.placement == "pending"
    with tw.step(0) as s:
        s.loss(1.0)
    tw.shutdown()
    assert headers(transport) == {(0, 1, 0)}
    assert agent.config.placement == "no process group"
    (start,) = [e for e in transport.events() if e["kind"] == "start"]
    assert start["data"]["rank_from"] == "no process group"
    assert [s["step"] for s in transport.steps()] == [0]


def test_srun_without_a_group_reports_slurm_s_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    transport = RecordingTransport()
    tw.init(run="srun", transport=transport, flush_interval_s=0.05)
    with tw.step(0):
        pass
    tw.shutdown()
    assert headers(transport) == {(3, 4, 1)}


def test_with_no_step_and_no_group_the_wait_ends_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TRAINWARDEN_IDENTITY_WAIT", "0.3")
    transport = RecordingTransport()
    tw.init(run="idle", transport=transport, flush_interval_s=0.05, heartbeat_s=0.1)
    deadline = time.monotonic() + 5
    while not transport.bodies and time.monotonic() < deadline:
        time.sleep(0.05)
    assert headers(transport) == {(0, 1, 0)}
    assert any("no process group after" in r.getMessage() for r in caplog.records)


def test_a_drill_acts_on_the_rank_the_process_will_report() -> None:
    transport = RecordingTransport()
    tw.init(run="drill", transport=transport, drill="slow=3x@rank=0,steps=1-1")
    with tw.step(0):
        pass
    with tw.step(1):
        time.sleep(0.02)
    tw.shutdown()
    durations = {s["step"]: s["duration_s"] for s in transport.steps()}
    assert durations[1] >= 0.055, durations  # the drill made it 3x as long: it is rank 0's


# -- real process groups, in spawned processes --------------------------------------------


def _rank_process(index: int, world: int, port: int, out: str, env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch.distributed as dist

    transport = RecordingTransport()
    relay = env.get("TRAINWARDEN_RELAY") == "auto"  # the agent's own HTTP transport, then
    agent = tw.init(
        run="group",
        transport=None if relay else transport,
        url="http://127.0.0.1:9" if relay else None,
        flush_interval_s=0.05,
        heartbeat_s=0.1,
    )
    time.sleep(0.4)
    before = len(transport.bodies)
    dist.init_process_group(
        "gloo", rank=index, world_size=world, init_method=f"tcp://127.0.0.1:{port}"
    )
    for step in range(3):
        with tw.step(step) as s:
            s.loss(float(index))
    tw.shutdown()
    result = {
        "sent_before_group": before,
        "headers": sorted(headers(transport)),
        "placement": agent.config.placement,
        "corrected": [e["data"] for e in transport.events() if e["kind"] == "rank_corrected"],
        "steps": sorted(s["step"] for s in transport.steps()),
        "local_rank": agent.config.local_rank,
        "runs_relay": agent._relay is not None,
    }
    Path(out, f"{index}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def spawn(tmp_path: Path, world: int, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    # Forked: this process has imported torch already (spawn would start it in each).
    mp.start_processes(
        _rank_process,
        args=(world, free_port(), str(tmp_path), env or {}),
        nprocs=world,
        join=True,
        start_method="fork",
    )
    return [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(world)]


def test_ranks_of_a_spawned_group_wait_for_it_then_report_its_ranks(tmp_path: Path) -> None:
    results = spawn(tmp_path, 3)
    for index, r in enumerate(results):
        assert r["sent_before_group"] == 0, r
        # One host: local ranks in rank order, learnt through the group's store.
        assert r["headers"] == [[index, 3, index]], r
        assert r["placement"] == "process group" and r["steps"] == [0, 1, 2]


def test_a_rank_in_the_environment_that_the_group_contradicts_is_corrected(
    tmp_path: Path,
) -> None:
    # Both processes inherit RANK=0 of 2 (a launcher script exporting one value to all).
    results = spawn(tmp_path, 2, {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert results[0]["corrected"] == [] and results[0]["placement"] == "environment"
    (corrected,) = results[1]["corrected"]
    assert corrected["was"] == 0 and "the process group says rank 1 of 2" in corrected["message"]
    assert results[1]["placement"] == "process group"
    assert [1, 2, 0] in results[1]["headers"]  # from the correction on: rank 1


def test_without_local_rank_one_process_of_the_node_runs_the_job_s_relay(tmp_path: Path) -> None:
    # A launcher that says the node runs 2 of the job's ranks (relay="auto" by default)
    # but no RANK nor LOCAL_RANK: only the group's local rank 0 may start the relay.
    results = spawn(tmp_path, 2, {"TRAINWARDEN_RELAY": "auto", "LOCAL_WORLD_SIZE": "2"})
    assert [(r["local_rank"], r["runs_relay"]) for r in results] == [(0, True), (1, False)]


def test_slurm_s_task_out_of_its_count_and_an_agreeing_group_are_not_taken() -> None:
    assert placement.without_group({"SLURM_PROCID": "5", "SLURM_NTASKS": "4"}).world_size == 1
    assert placement.differs(placement.Place(0, 2, 0, "environment"), 0, 2) is None
    said = placement.differs(placement.Place(0, 2, 0, "argument"), 1, 2)
    assert said is not None and "tw.init's arguments say rank 0 of 2" in said


def test_srun_s_local_id_counts_only_where_srun_started_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert placement.from_group(3, 4, host="h", run="r").local_rank == 1
    # One srun task that spawned 8 ranks: its SLURM_LOCALID says nothing of theirs (here
    # no group's store answers either: local rank 0, said in the log).
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert placement.from_group(3, 8, host="h", run="r").local_rank == 0
