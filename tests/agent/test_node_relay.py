"""relay="auto", the default where a node runs several of a job's ranks: which relay a
rank looks for, and when the agent picks it on its own."""

from __future__ import annotations

import pytest

from trainwarden.agent.config import AgentConfig
from trainwarden.agent.node_relay import (
    CANDIDATES,
    PORT_BASE,
    PORT_SPAN,
    candidate_ports,
    job_key,
    local_world_size,
    urls,
)

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "LOCAL_WORLD_SIZE": "8",
}


def test_the_local_world_comes_from_torchrun_or_slurm() -> None:
    assert local_world_size({"LOCAL_WORLD_SIZE": "8"}) == 8
    # Slurm: 3 nodes of 2 tasks, then one of 1; this task runs on the node of index 3.
    slurm = {"SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}
    assert local_world_size(slurm) == 1
    assert local_world_size({**slurm, "SLURM_NODEID": "1"}) == 2
    assert local_world_size({**slurm, "SLURM_NODEID": "4"}) is None  # not in the list
    assert local_world_size({"SLURM_TASKS_PER_NODE": "many", "SLURM_NODEID": "0"}) is None
    assert local_world_size({}) is None


def test_each_job_has_its_own_ports_and_every_local_rank_computes_the_same() -> None:
    key = job_key("llama", TORCHRUN)
    assert key == job_key("llama", {**TORCHRUN, "LOCAL_RANK": "5"})
    others = [
        job_key("llama", {**TORCHRUN, "MASTER_PORT": "29501"}),  # another job on the node
        job_key("llama", {**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "1"}),  # its next attempt
        job_key("mistral", TORCHRUN),
        job_key("llama", {"SLURM_JOB_ID": "7", "MASTER_PORT": "29500"}),
    ]
    assert len({key, *others}) == 5
    ports = candidate_ports(key)
    assert len(ports) == len(set(ports)) == CANDIDATES
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert ports != candidate_ports(others[0])
    assert candidate_ports(key, pinned=8470) == [8470]


def test_relay_auto_is_the_default_where_a_node_runs_several_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRAINWARDEN_RELAY", raising=False)
    monkeypatch.delenv("TRAINWARDEN_RELAY_PORT", raising=False)
    url = "http://collector:8000"
    config = AgentConfig.resolve(run="r", url=url)
    assert config.relay == "auto" and config.relay_port is None
    assert urls(config) == [f"http://127.0.0.1:{p}" for p in candidate_ports(job_key("r"))]
    assert AgentConfig.resolve(run="r", url=url, relay="off").relay is None
    monkeypatch.setenv("TRAINWARDEN_RELAY", "off")
    assert AgentConfig.resolve(run="r", url=url).relay is None
    monkeypatch.delenv("TRAINWARDEN_RELAY")
    # No collector, or OTLP (no relay speaks it): none.
    assert AgentConfig.resolve(run="r").relay is None
    assert AgentConfig.resolve(run="r", url=url, exporter="otlp").relay is None
    # One rank a node: nothing to merge.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert AgentConfig.resolve(run="r", url=url).relay is None
    # A pinned port.
    monkeypatch.setenv("TRAINWARDEN_RELAY_PORT", "8470")
    config = AgentConfig.resolve(run="r", url=url, relay="auto")
    assert urls(config) == ["http://127.0.0.1:8470"]
    monkeypatch.setenv("TRAINWARDEN_RELAY_PORT", "0")
    with pytest.raises(ValueError, match="relay port"):
        AgentConfig.resolve(run="r", url=url, relay="auto")
