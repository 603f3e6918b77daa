"""The hot path of ``tw.step`` (agent/step.py) and what sends a step down the rare path
(agent/rare.py): only the steps that need the rare work pay for it."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

import trainwarden.agent as tw
from trainwarden.agent.profiler import SampledProfiler
from trainwarden.agent.rare import RareWork

from .helpers import RecordingTransport

pytestmark = pytest.mark.usefixtures("clean_agent")

# On a machine whose torch sees a GPU, every step asks whether the trainer uses it.
CUDA = torch.cuda.is_available()


@pytest.fixture
def rare_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The steps that took the rare path, in order."""
    seen: list[int] = []
    enter = RareWork.enter

    def counting_enter(self: RareWork, record: Any) -> Any:
        seen.append(record.step)
        return enter(self, record)

    monkeypatch.setattr(RareWork, "enter", counting_enter)
    return seen


def test_only_the_profilers_window_steps_take_the_rare_path(rare_steps: list[int]) -> None:
    transport = RecordingTransport()
    tw.init(run="hot", transport=transport, profile_every=7, gpu_interval_s=0)
    for i in range(22):
        with tw.step(i) as s:
            s.loss(1.0)
    tw.shutdown()
    # The first (it settles the process's rank: placement.py), the 7th, 14th, 20th (the
    # first window) and 21st step run.
    assert rare_steps == (list(range(22)) if CUDA else [0, 6, 13, 19, 20])
    profiled = [s["step"] for s in transport.steps() if s.get("comm_source") == "profiler"]
    assert profiled == [6, 13, 19, 20]


def test_a_flop_count_takes_the_rare_path_once(rare_steps: list[int]) -> None:
    tw.init(run="hot", transport=RecordingTransport(), profile_every=0, gpu_interval_s=0)
    for i in range(3):
        with tw.step(i):
            pass
    model = nn.Linear(4, 4)
    tw.watch(model)  # no FLOPs given: it counts them on the next step
    for i in range(3, 6):
        with tw.step(i, tokens=2):
            model(torch.randn(2, 4))
    tw.shutdown()
    assert rare_steps == (list(range(6)) if CUDA else [0, 3])  # the first, and the count


def test_under_a_drill_every_step_takes_the_rare_path(rare_steps: list[int]) -> None:
    tw.init(
        run="hot",
        transport=RecordingTransport(),
        profile_every=0,
        gpu_interval_s=0,
        drill="slow=1.01x@rank=0,steps=100-101",
    )
    for i in range(4):
        with tw.step(i):
            pass
    tw.shutdown()
    assert rare_steps == [0, 1, 2, 3]


@pytest.mark.parametrize("every", [1, 3, 7, 10, 19, 20, 21, 40, 1000])
def test_the_rare_flag_points_at_the_next_profiled_step(every: int) -> None:
    profiler = SampledProfiler(every=every)
    due = [n for n in range(1, 3100) if profiler.due(n)]
    for count in range(2500):
        assert profiler.next_due(count) == next(n for n in due if n > count), count
    assert SampledProfiler(every=0).next_due(0) == sys.maxsize  # off: never


@pytest.mark.parametrize("kineto_log_level", [None, "0"])
def test_the_profilers_windows_print_nothing_unless_the_trainer_set_kinetos_level(
    kineto_log_level: str | None,
) -> None:
    """Kineto prints ``USDT: ... profiler_start`` / ``profiler_stop`` to stderr for each
    window; the agent quiets it when the trainer did not choose a level (a process of its
    own: Kineto reads the level once, at its first start)."""
    import os
    import subprocess
    import textwrap

    trainer = textwrap.dedent("""
        import torch
        import trainwarden.agent as tw
        tw.init(run="quiet", spool_dir="none", profile_every=5)
        for step in range(30):
            with tw.step(step):
                torch.ones(64, 64) @ torch.ones(64, 64)
        tw.shutdown()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINWARDEN_", "KINETO_"))}
    if kineto_log_level is not None:
        env["KINETO_LOG_LEVEL"] = kineto_log_level
    done = subprocess.run(
        [sys.executable, "-c", trainer], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = (done.stdout + done.stderr).count("profiler_start")
    if kineto_log_level is None:
        assert printed == 0, done.stderr[-3000:]
    else:  # the trainer's own level is kept: every window says so (the first at step 20)
        assert printed >= 2, done.stderr[-3000:]
