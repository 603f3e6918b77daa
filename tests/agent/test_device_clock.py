"""The GPU-clock path (agent/device_clock.py) on a machine without a GPU.

A stand-in for ``torch.cuda``'s events is the only way to run this path here: each
event stamps the host's clock scaled 3x, i.e. a GPU whose work takes three times the
host's time, so every figure the agent reports must come out 3x the host's. The real
path runs in tests/agent/test_gpu.py on a GPU (seen on an H200: within 0.01 ms of CUDA
events around the step).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import trainwarden.agent as tw

from .helpers import RecordingTransport

SLOWER = 3.0


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        self.at = time.perf_counter() * SLOWER

    def query(self) -> bool:
        return self.at is not None

    def elapsed_time(self, other: FakeEvent) -> float:
        assert self.at is not None and other.at is not None
        return (other.at - self.at) * 1000  # ms, as torch.cuda.Event says


class FakeCuda:
    Event = FakeEvent
    capturing = False

    @classmethod
    def is_current_stream_capturing(cls) -> bool:
        return cls.capturing


class FakeTorch:
    cuda = FakeCuda


@pytest.fixture
def gpu_agent() -> Any:
    """An agent that believes the trainer runs on a (3x slower) GPU."""
    transport = RecordingTransport()
    tw.init(run="clock", transport=transport, profile_every=0, gpu_interval_s=0)
    rare = tw.init.__globals__["_core"]._agent.rare  # the CUDA state lives with the rare work
    rare.torch, rare.cuda, rare.cuda_possible = FakeTorch, True, True
    rare.schedule()  # from now on every step takes the rare path (the GPU's clock)
    yield transport
    FakeCuda.capturing = False
    tw.shutdown()


# Serial: it compares the agent's marks with the test's own clock within 3 ms, and a
# parallel worker's load can preempt the test between its clock and the agent's.
@pytest.mark.serial
def test_steps_phases_and_data_wait_come_from_the_gpus_clock(gpu_agent: Any) -> None:
    host: dict[int, dict[str, float]] = {}  # what the host saw, to compare with 3x
    ended = None
    for i in range(4):
        time.sleep(0.01)  # between steps: the GPU waits
        t0 = time.perf_counter()
        with tw.step(i) as s:
            s.phase("forward")
            time.sleep(0.02)
            t1 = time.perf_counter()
            s.phase("backward")
            time.sleep(0.02)
        t2 = time.perf_counter()
        host[i] = {
            "duration_s": t2 - t0,
            "fwd_s": t1 - t0,
            "bwd_s": t2 - t1,
            "data_wait_s": t0 - ended if ended is not None else 0.0,
        }
        ended = t2
    tw.shutdown()
    steps = gpu_agent.steps()
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert steps[0]["data_wait_s"] is None
    for s in steps:
        assert "issues" not in s, s
        seen = host[s["step"]]
        for key in ("duration_s", "fwd_s", "bwd_s") + (("data_wait_s",) if s["step"] else ()):
            # The agent's marks are a few microseconds inside the test's own.
            assert s[key] == pytest.approx(seen[key] * SLOWER, rel=0.1, abs=0.003), (key, s)


def test_marks_under_cuda_graph_capture_are_left_out(gpu_agent: Any) -> None:
    with tw.step(0) as s:
        s.phase("forward")
        time.sleep(0.02)
        FakeCuda.capturing = True  # a capture begins: this mark cannot go on the GPU
        s.phase("backward")
        FakeCuda.capturing = False
        time.sleep(0.02)
    tw.shutdown()
    (step,) = gpu_agent.steps()
    assert "issues" not in step, step
    assert step["duration_s"] > 0.04 * SLOWER * 0.95  # the GPU's clock (3x), not the host's
    # No backward mark: forward runs to the step's end, over both sleeps. The time
    # before the forward mark is "other" (under a loaded worker it was 0.6 ms, 2 % of
    # the GPU's 120 ms, in CI): the phases still add up to the step.
    assert step["bwd_s"] == 0
    assert step["fwd_s"] > 0.04 * SLOWER * 0.95
    assert step["fwd_s"] + step["other_s"] == pytest.approx(step["duration_s"], abs=1e-6)
