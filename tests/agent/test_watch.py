"""tw.watch and MFU on a real (single-process) training loop; the DDP comm hook is
tested on two gloo ranks in tests/e2e/test_comm_split.py."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import trainwarden.agent as tw

from .helpers import RecordingTransport

BATCH, D_IN, D_HIDDEN, D_OUT = 64, 256, 512, 128


def hand_flops(batch: int) -> int:
    # forward 2*B*(in*h + h*out); backward: weight grads of both layers + input grad of the second
    return 4 * batch * (D_IN * D_HIDDEN + D_HIDDEN * D_OUT) + 2 * batch * D_HIDDEN * D_OUT


HAND_FLOPS = hand_flops(BATCH)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.ReLU(), nn.Linear(D_HIDDEN, D_OUT))


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch):
    for name in ("RANK", "WORLD_SIZE", "TRAINWARDEN_URL"):
        monkeypatch.delenv(name, raising=False)
    yield
    tw.shutdown(timeout_s=1)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: range,
    *,
    scale_at: int | None = None,
    tokens: int | None = BATCH,
    batch: int = BATCH,
    inside: dict[int, float] | None = None,
) -> dict[int, float]:
    """Each step's time as the loop measured it around the step; ``inside``, if given,
    gets the time of each step's body, as measured within it."""
    x, y = torch.randn(batch, D_IN), torch.randn(batch, D_OUT)
    outside: dict[int, float] = {}
    for i in steps:
        t0 = time.perf_counter()
        with tw.step(i, tokens=tokens) as s:
            began = time.perf_counter()
            loss = (model(x) - y).square().mean()
            if i == scale_at:
                loss = loss * 1000  # a real gradient spike: 1000x the gradients
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss(loss)
            ended = time.perf_counter()
        outside[i] = time.perf_counter() - t0
        if inside is not None:
            inside[i] = ended - began
    return outside


def test_mfu_with_given_flops_and_peak_matches_the_hand_formula() -> None:
    transport = RecordingTransport()
    peak, batch = 50e9, 2048  # a step of some milliseconds, as real steps are
    flops = hand_flops(batch)
    tw.init(run="mfu", transport=transport, flops_per_step=flops, peak_flops=peak, profile_every=0)
    model = mlp()
    body: dict[int, float] = {}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    wall = train(model, opt, range(20), batch=batch, inside=body)
    tw.shutdown()
    steps = transport.steps()
    assert len(steps) == 20
    for s in steps:
        # The hand formula on the step time the agent reports...
        assert s["mfu"] == pytest.approx(flops / (s["duration_s"] * peak), rel=1e-9)
        # ... which is the step's: inside what the loop measured around it, and all of
        # its body as measured within it (the test's own clocks, not a ratio: a loaded
        # machine can preempt the loop anywhere).
        assert 0 < body[s["step"]] <= s["duration_s"] <= wall[s["step"]]
        assert (s["flops"], s["peak_flops"]) == (flops, peak)
        assert s["peak_source"] == "given" and s["flops_source"] == "given: flops_per_step"


def test_watch_counts_flops_once_then_reports_mfu_on_a_measured_cpu_peak() -> None:
    transport = RecordingTransport()
    tw.init(run="auto", transport=transport)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tw.watch(model, opt)
    wall = train(model, opt, range(6))
    tw.shutdown()
    steps = transport.steps()
    assert steps[0]["flops"] == HAND_FLOPS  # the counted step
    assert "mfu" not in steps[0] and "counted" in steps[0]["issues"]["timing"]
    for s in steps[1:]:
        assert s["flops"] == pytest.approx(HAND_FLOPS)  # flops/token x tokens
        assert s["flops_source"] == "counted: FlopCounterMode over one step"
        # The peak is the GPU's once this process has initialized CUDA (a GPU test ran
        # earlier in it), else the CPU's, measured.
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        assert s["peak_source"].startswith("table: " if cuda else "measured: cpu")
        # MFU is the step's FLOPs over its time at the peak. Not bounded by 1 here: the
        # CPU peak is measured once, and a test run on two busy cores can measure it slow
        # (a clean-clone CI run saw 2.57).
        assert s["mfu"] > 0 and s["peak_flops"] > 0
        # The FLOPs counted by hand (not the agent's field), over the step's time, which
        # lies inside what the loop measured around it.
        assert 0 < s["duration_s"] <= wall[s["step"]]
        assert s["mfu"] == pytest.approx(HAND_FLOPS / (s["duration_s"] * s["peak_flops"]))


def test_watch_times_forward_backward_and_optimizer() -> None:
    transport = RecordingTransport()
    tw.init(run="phases", transport=transport)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tw.watch(model, opt, count_flops=False)
    train(model, opt, range(5))
    tw.shutdown()
    for s in transport.steps():
        parts = [s["fwd_s"], s["bwd_s"], s["opt_s"], s["other_s"]]
        assert all(p >= 0 for p in parts) and s["fwd_s"] > 0 and s["bwd_s"] > 0 and s["opt_s"] > 0
        assert sum(parts) == pytest.approx(s["duration_s"], abs=1e-6)
        assert "mfu" not in s and "compute_s" not in s  # no FLOPs asked for; no DDP here


def test_an_injected_gradient_spike_is_flagged_on_that_step_not_before() -> None:
    transport = RecordingTransport()
    tw.init(run="spike", transport=transport)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    tw.watch(model, opt, grad_norm=True, count_flops=False)
    train(model, opt, range(60), scale_at=45)
    tw.shutdown()
    steps = transport.steps()
    assert all(s["grad_norm"] > 0 for s in steps)
    flagged = [s["step"] for s in steps if "grad_norm_spike" in s.get("flags", [])]
    assert flagged == [45]
    assert "skip_suggested" in steps[45]["flags"]
    assert "loss_spike" in steps[45]["flags"]


def test_should_skip_step_answers_synchronously() -> None:
    tw.init(run="skip", transport=RecordingTransport())
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    tw.watch(model, opt, count_flops=False)
    x = torch.randn(BATCH, D_IN)
    answers = []
    for i in range(40):
        with tw.step(i) as s:
            loss = model(x).square().mean() * (1000 if i == 35 else 1)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
            s.grad_norm(norm)
            answers.append(s.should_skip_step())
            opt.zero_grad()
    assert answers[35] is True and not any(answers[21:35])


def test_mfu_needs_tokens_when_flops_are_per_token() -> None:
    transport = RecordingTransport()
    tw.init(run="pt", transport=transport, flops_per_token=1e6, peak_flops=1e12)
    model = mlp()
    train(model, torch.optim.SGD(model.parameters(), lr=1e-3), range(2), tokens=None)
    tw.shutdown()
    assert "flops_per_token needs" in transport.steps()[0]["issues"]["mfu"]


def test_wrong_mfu_arguments_raise_with_the_fix() -> None:
    with pytest.raises(tw.ConfigError, match="not both"):
        tw.init(run="x", flops_per_step=1, flops_per_token=1)
    with pytest.raises(tw.ConfigError, match="dtype"):
        tw.init(run="x", dtype="int4")
    with pytest.raises(tw.ConfigError, match="peak_flops"):
        tw.init(run="x", peak_flops=-1)


def test_sampled_profiler_windows_follow_the_cadence_and_keep_no_trace(tmp_path) -> None:
    from trainwarden.agent.profiler import SampledProfiler

    every = SampledProfiler(every=10)
    assert [n for n in range(1, 45) if every.due(n)] == [10, 20, 30, 40]
    assert not any(SampledProfiler(every=0).due(n) for n in range(1, 100))

    transport = RecordingTransport()
    tw.init(run="prof", transport=transport, profile_every=7, profile_dir=str(tmp_path / "traces"))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tw.watch(model, opt, count_flops=False)
    train(model, opt, range(21))
    tw.shutdown()
    profiled = [s["step"] for s in transport.steps() if s.get("comm_source") == "profiler"]
    assert profiled == [6, 13, 19, 20]  # the 7th, 14th, 21st step run, and the 20th (first window)
    for s in transport.steps():
        if s["step"] in profiled:
            # No collectives in a single process: all compute or idle.
            assert s["exposed_comm_s"] == 0 and s["overlapped_comm_s"] == 0
            assert s["compute_s"] > 0 and s["compute_s"] + s["idle_s"] == pytest.approx(
                s["duration_s"], abs=1e-3
            )
    assert len(list((tmp_path / "traces").glob("*.json"))) == 4


def test_step_numbers_going_backwards_are_recorded_as_they_are() -> None:
    transport = RecordingTransport()
    tw.init(run="back", transport=transport)
    for i in [10, 11, 12, 5, 6]:  # resumed from an earlier checkpoint
        with tw.step(i) as s:
            s.loss(1.0)
    tw.shutdown()
    assert [s["step"] for s in transport.steps()] == [10, 11, 12, 5, 6]


# Serial: its bound (20 ms of loader, not 120 ms with the profiler's setup) is a wall-clock
# time that a parallel worker's load would stretch.
@pytest.mark.serial
def test_sampling_work_does_not_count_as_data_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainwarden.agent.profiler import SampledProfiler

    # Make the agent's sampling work slow (100 ms to start and to stop the profiler,
    # as a GPU flush can be): none of it may show up as the trainer's data wait.
    start, stop = SampledProfiler.start, SampledProfiler.stop

    def slow_start(self):  # type: ignore[no-untyped-def]
        time.sleep(0.1)
        return start(self)

    def slow_stop(self, handle, step):  # type: ignore[no-untyped-def]
        result = stop(self, handle, step)
        time.sleep(0.1)
        return result

    monkeypatch.setattr(SampledProfiler, "start", slow_start)
    monkeypatch.setattr(SampledProfiler, "stop", slow_stop)
    transport = RecordingTransport()
    tw.init(run="dw", transport=transport, profile_every=4)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tw.watch(model, opt)  # also counts FLOPs on the first step
    x = torch.randn(BATCH, D_IN)
    for i in range(12):
        time.sleep(0.02)  # the loader: 20 ms before every step
        with tw.step(i, tokens=BATCH):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps if s.get("comm_source") == "profiler"] == [3, 7, 11]
    waits = [s["data_wait_s"] for s in steps[1:]]
    assert all(0.019 < w < 0.07 for w in waits), waits  # 20 ms, not 120 ms
