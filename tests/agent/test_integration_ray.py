"""The Ray Train integration's parts that run outside a Ray cluster
(agent/integrations/ray.py); the whole of it runs in tests/e2e/test_ray_integration.py.

- The attempt key and restart count from the markers each worker leaves in the
  experiment's storage, on a real local filesystem (pyarrow's, as Ray's storage uses).
  Ray's train context is stood in for by :class:`Context`: the two attributes of its
  ``get_storage()`` that the integration reads, nothing of Ray's behaviour.
- ``wrap`` outside a Ray worker: said once, the loop runs unobserved, a stop's
  ``SystemExit(76)`` ends the loop as a return, any other exit goes on."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow.fs
import pytest
import ray.train

import trainwarden.agent as tw
from trainwarden.agent import core
from trainwarden.agent.integrations import ray as tw_ray


class Context:
    """What ``attempt`` reads of Ray's train context: its storage's filesystem and the
    experiment's path on it."""

    def __init__(self, root: Path) -> None:
        self.storage_filesystem = pyarrow.fs.LocalFileSystem()
        self.experiment_fs_path = str(root / "exp")

    def get_storage(self) -> Context:
        return self


def test_each_worker_group_is_an_attempt_counted_from_the_groups_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    context = Context(tmp_path)
    # Outside a placement group the rendezvous port names the group.
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert tw_ray.attempt(context, "exp", 1) == ("ray:exp:port29500", 0)
    assert tw_ray.attempt(context, "exp", 0) == ("ray:exp:port29500", 0)  # its peer
    monkeypatch.setenv("MASTER_PORT", "29611")  # Ray restarted the group
    assert tw_ray.attempt(context, "exp", 0) == ("ray:exp:port29611", 1)
    assert tw_ray.attempt(context, "exp", 1) == ("ray:exp:port29611", 1)
    monkeypatch.setenv("MASTER_PORT", "29733")
    assert tw_ray.attempt(context, "exp", 1) == ("ray:exp:port29733", 2)
    marks = sorted(p.name for p in (tmp_path / "exp" / tw_ray.MARKERS).iterdir())
    assert marks == [
        "port29500.0",
        "port29500.1",
        "port29611.0",
        "port29611.1",
        "port29733.1",
    ]


def test_wrap_outside_a_ray_worker_runs_the_loop_unobserved_and_a_stop_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    report = ray.train.report
    ran: list[Any] = []

    def loop(config: dict[str, Any]) -> str:
        ran.append(config)
        return "done"

    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        assert tw_ray.wrap(loop)({"steps": 3}) == "done"
    assert ran == [{"steps": 3}] and core._agent is None
    assert caplog.text.count("trainwarden: Ray Train: no train context") == 1

    def stopped(config: dict[str, Any]) -> None:
        raise SystemExit(tw.STOPPED_EXIT_CODE)  # what tw.step raises on a stop

    assert tw_ray.wrap(stopped)({}) is None  # Ray then ends the run as finished

    def failed(config: dict[str, Any]) -> None:
        raise SystemExit(3)

    with pytest.raises(SystemExit) as exit_:
        tw_ray.wrap(failed)({})
    assert exit_.value.code == 3  # a failure: Ray's FailureConfig decides
    assert ray.train.report is report  # the wrapper put Ray's own back
