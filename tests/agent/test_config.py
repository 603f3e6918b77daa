from __future__ import annotations

import pytest

from trainwarden.agent import AgentConfig, ConfigError


def test_reads_rank_world_and_node_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-node-17")
    monkeypatch.setenv("TRAINWARDEN_URL", "http://collector:8000/")
    config = AgentConfig.resolve(run="r1")
    assert (config.rank, config.world_size, config.local_rank) == (3, 8, 1)
    assert config.node == "gpu-node-17"
    assert config.url == "http://collector:8000"


def test_explicit_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWARDEN_RUN", "from-env")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    config = AgentConfig.resolve(run="explicit", rank=0, world_size=1)
    assert (config.run, config.rank, config.world_size) == ("explicit", 0, 1)


def test_node_falls_back_to_node_name_then_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    monkeypatch.setenv("NODE_NAME", "k8s-node-2")
    assert AgentConfig.resolve(run="r").node == "k8s-node-2"
    monkeypatch.delenv("NODE_NAME")
    config = AgentConfig.resolve(run="r")
    assert config.node == config.host


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({}, {}, "TRAINWARDEN_RUN"),
        ({"run": "has space"}, {}, "is not valid"),
        ({"run": "r", "url": "collector:8000"}, {}, "http://host:port"),
        ({"run": "r"}, {"RANK": "2", "WORLD_SIZE": "2"}, "outside world_size 2"),
        ({"run": "r"}, {"RANK": "two"}, "RANK"),
        ({"run": "r", "queue_size": 0}, {}, "queue_size"),
        ({"run": "r", "flush_interval_s": -1}, {}, "flush_interval_s"),
    ],
)
def test_wrong_arguments_raise_at_once_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, kwargs: dict, env: dict, message: str
) -> None:
    for name in ("TRAINWARDEN_RUN", "TRAINWARDEN_URL", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        AgentConfig.resolve(**kwargs)


def test_init_s_arguments_are_declared_once_and_a_misspelt_one_is_named() -> None:
    """``InitOptions`` declares ``tw.init``'s keyword arguments for ``tw.init``,
    ``AgentConfig.resolve``, ``help(tw.init)`` and type checkers alike; each resolves to
    the ``AgentConfig`` field of its name."""
    import dataclasses
    import inspect

    import trainwarden.agent as tw
    from trainwarden.agent.config import InitOptions

    params = list(inspect.signature(tw.init).parameters)
    assert params == ["run", "url", "token", "transport", *InitOptions.__annotations__]
    assert "queue_size" in params and "data_mixture" in params
    fields = {f.name for f in dataclasses.fields(AgentConfig)}
    renamed = {"config": "run_config", "spool_max_mb": "spool_max_bytes"}
    assert {renamed.get(n, n) for n in InitOptions.__annotations__} <= fields
    with pytest.raises(ConfigError, match=r"'queue_sise': not an argument of it; .* queue_size,"):
        tw.init(run="r", queue_sise=3)  # type: ignore[call-arg]
