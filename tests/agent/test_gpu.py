"""The agent on a real CUDA device. The only tests that may skip: when no GPU is present.

Run on a machine with a GPU: ``./scripts/test.sh tests/agent/test_gpu.py -s``.
"""

from __future__ import annotations

import statistics
import subprocess
import time

import pytest
import torch
from torch import nn

import trainwarden.agent as tw

from .helpers import RecordingTransport

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def test_instrumented_steps_never_sync_the_device_and_report_mfu() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]).to(device, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
    flops = 3 * 2 * 8192 * 4096 * 4096 * 4  # forward + backward of 4 linears
    transport = RecordingTransport()
    # No profiler window here: stopping torch.profiler flushes the device (documented).
    tw.init(run="gpu", transport=transport, flops_per_step=flops, dtype="bf16", profile_every=0)
    tw.watch(model, opt, grad_norm=True, count_flops=False)
    for i in range(3):  # warm-up outside the sync check (cuBLAS handles, allocator)
        with tw.step(i) as s:
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss(loss)
    torch.cuda.synchronize()
    # The GPU's own times of each step, from events around the agent's step: the truth
    # the agent's step time must match while the host runs ahead of the GPU.
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(30)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(30)]
    host = {}
    torch.cuda.set_sync_debug_mode("error")  # any host-device sync below raises
    try:
        for i in range(3, 30):
            starts[i].record()
            t0 = time.perf_counter()
            with tw.step(i, tokens=8192) as s:
                loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                s.loss(loss)
            host[i] = time.perf_counter() - t0
            ends[i].record()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    tw.shutdown()
    steps = transport.steps()
    assert len(steps) == 30
    name = torch.cuda.get_device_name()
    print(f"\n{name}: peak {steps[-1].get('peak_source')}")
    ahead = 0
    ratios: list[float] = []
    for s in steps[5:]:
        i = s["step"]
        assert s["loss"] is not None and s["grad_norm"] is not None
        assert s["mem_allocated_bytes"] > 0
        gpu_s = starts[i].elapsed_time(ends[i]) / 1000
        ahead += host[i] < gpu_s / 2
        print(
            f"step {i}: agent {s['duration_s'] * 1000:.2f} ms, GPU {gpu_s * 1000:.2f} ms, "
            f"host {host[i] * 1000:.2f} ms, MFU {s.get('mfu', 0):.3f}"
        )
        # The agent's events lie inside ours: never longer. (Ours can be longer: a host
        # stall between them lets the GPU idle outside the agent's step; seen once.)
        assert s["duration_s"] <= gpu_s * 1.01 + 1e-4
        ratios.append(s["duration_s"] / gpu_s)
        assert 0 < s["mfu"] < 1
    assert ahead > 0, "the host never ran ahead of the GPU: this test did not test that case"
    assert statistics.median(ratios) == pytest.approx(1, abs=0.02), ratios


def test_a_step_without_gpu_work_keeps_its_host_time_after_cuda_is_up() -> None:
    torch.ones(1, device="cuda").sum().item()  # CUDA initialized: the agent uses its clock
    transport = RecordingTransport()
    tw.init(run="gpu-idle", transport=transport, profile_every=0)
    for i in range(4):
        time.sleep(0.01)  # between steps: the GPU waits (data wait)
        with tw.step(i):
            time.sleep(0.02)  # CPU work only: the idle GPU reaches each event at once
    tw.shutdown()
    steps = transport.steps()
    assert all(0.019 < s["duration_s"] < 0.05 for s in steps), steps
    assert all(0.009 < s["data_wait_s"] < 0.05 for s in steps[1:]), steps


def test_sampled_profiler_reads_the_kernel_timeline() -> None:
    model = nn.Linear(4096, 4096).cuda()
    x = torch.randn(4096, 4096, device="cuda")
    transport = RecordingTransport()
    tw.init(run="gpu-prof", transport=transport, profile_every=5)
    for i in range(10):
        with tw.step(i) as s:
            loss = model(x).square().mean()
            loss.backward()
            s.loss(loss)
    tw.shutdown()
    profiled = [s for s in transport.steps() if s.get("comm_source") == "profiler"]
    assert [s["step"] for s in profiled] == [4, 9]
    for s in profiled:
        assert s["compute_s"] > 0 and s["exposed_comm_s"] == 0  # kernels, no NCCL


def _nvml_device_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return count > 0
    except Exception:
        return False


@pytest.mark.skipif(not _nvml_device_present(), reason="no NVML device")
def test_real_nvml_sampler_and_xid_listener() -> None:
    from trainwarden.agent.gpu import NvmlDevice

    device = NvmlDevice(0)
    sample = device.sample()
    print(f"\n{device.name}: {sample}")
    for field in (
        "temp_c",
        "power_w",
        "power_limit_w",
        "sm_clock_mhz",
        "sm_clock_max_mhz",
        "mem_used_bytes",
    ):
        assert field in sample, field
    assert 0 < sample["temp_c"] < 120
    assert isinstance(sample.get("throttle", []), list)
    # The same GPU as nvidia-smi reads it in the same second (its own NVML session).
    fields = "temperature.gpu,enforced.power.limit,clocks.max.sm,memory.total,memory.used"
    smi = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert smi.returncode == 0, smi.stderr
    temp, limit, max_sm, total_mib, used_mib = (float(v) for v in smi.stdout.split(","))
    assert abs(sample["temp_c"] - temp) <= 3, (sample, smi.stdout)
    assert sample["power_limit_w"] == pytest.approx(limit, abs=1), (sample, smi.stdout)
    assert sample["sm_clock_max_mhz"] == max_sm, (sample, smi.stdout)
    # (nvidia-smi may count the driver's reserved memory apart from "used": 1 GiB of slack)
    assert sample["mem_total_bytes"] / 2**20 == pytest.approx(total_mib, rel=0.02)
    assert abs(sample["mem_used_bytes"] / 2**20 - used_mib) <= 1024, (sample, smi.stdout)
    assert device.wait_xid(200) is None  # the listener registers and waits without error
    device.close()


def test_a_child_forked_after_cuda_is_up_steps_without_touching_cuda() -> None:
    import json
    import os

    torch.ones(1, device="cuda").sum().item()
    transport = RecordingTransport()
    tw.init(run="gpu-fork", transport=transport)
    with tw.step(0):
        torch.ones(1, device="cuda").sum()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a DataLoader worker: CUDA is unusable here, and the agent must not try
        code = 1
        try:
            with tw.step(1):
                pass
            os.write(write, json.dumps({"ok": True}).encode())
            code = 0
        except BaseException as exc:
            os.write(write, json.dumps({"error": repr(exc)}).encode())
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    child = json.loads(os.read(read, 1000))
    os.close(read)
    tw.shutdown()
    assert child == {"ok": True} and os.WEXITSTATUS(status) == 0
    assert [s["step"] for s in transport.steps()] == [0]


def test_a_cuda_graph_captured_and_replayed_inside_steps() -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()).cuda()
    x = torch.randn(256, 1024, device="cuda")
    side = torch.cuda.Stream()  # warm-up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    transport = RecordingTransport()
    tw.init(run="gpu-graph", transport=transport, profile_every=0)
    tw.watch(model)  # its hooks fire during the capture: no event may be recorded there
    graph = torch.cuda.CUDAGraph()
    with tw.step(0), torch.cuda.graph(graph):
        y = model(x)
    for i in range(1, 4):
        with tw.step(i) as s:
            graph.replay()
            s.loss(y.sum())
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert all(s["duration_s"] > 0 and "step_time" not in s.get("issues", {}) for s in steps)
    assert all(s["loss"] is not None for s in steps[1:])


def test_manual_phases_are_timed_on_the_gpus_clock() -> None:
    """``s.phase()`` marks go on the GPU's clock (f9fca17): while the host only queues the
    matmuls, each phase's time is the GPU's, as CUDA events beside the marks measure it."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()  # cuBLAS up
    transport = RecordingTransport()
    tw.init(run="gpu-phases", transport=transport, profile_every=0)
    events: dict[int, list[torch.cuda.Event]] = {}
    host: dict[int, float] = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(8):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            t0 = time.perf_counter()
            with tw.step(i) as s:
                ev[0].record()
                s.phase("forward")
                for _ in range(4):
                    a @ a
                ev[1].record()
                s.phase("backward")
                for _ in range(8):
                    a @ a
                ev[2].record()
            host[i] = time.perf_counter() - t0
            events[i] = ev
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    tw.shutdown()
    steps = transport.steps()
    assert [s["step"] for s in steps] == list(range(8))
    for s in steps[1:]:
        ev = events[s["step"]]
        fwd, bwd = ev[0].elapsed_time(ev[1]) / 1000, ev[1].elapsed_time(ev[2]) / 1000
        print(
            f"step {s['step']}: fwd agent {s['fwd_s'] * 1000:.2f} / GPU {fwd * 1000:.2f} ms, "
            f"bwd {s['bwd_s'] * 1000:.2f} / {bwd * 1000:.2f} ms, host "
            f"{host[s['step']] * 1000:.2f} ms"
        )
        assert s["fwd_s"] == pytest.approx(fwd, rel=0.05, abs=2e-4), s
        assert s["bwd_s"] == pytest.approx(bwd, rel=0.05, abs=2e-4), s
    # The host only queued the work: its own time for a step is far below the GPU's.
    assert min(host.values()) < 0.5 * min(s["duration_s"] for s in steps[1:]), host


def test_the_determinism_probe_on_the_gpu_never_syncs_and_fingerprints_the_output() -> None:
    """A probed step's forward, fingerprint and sums are queued on the device and read
    back as the loss is: no host sync (``set_sync_debug_mode("error")``), and the probe
    sent for the last step is the fingerprint of the model's eval output on the input."""
    from trainwarden.agent.replica import fingerprint, hex_words

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256))
    model = model.to(device, torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(512, 1024, device=device, dtype=torch.bfloat16)
    fixed = torch.randn(4, 1024, device=device, dtype=torch.bfloat16)
    transport = RecordingTransport()
    tw.init(run="gpu-probe", transport=transport, profile_every=0)
    tw.watch(
        model,
        opt,
        count_flops=False,
        replica_group=[0],
        replica_check_every=3,
        determinism_probe_every=3,
        probe_input=fixed,
    )

    def step(i: int) -> None:
        with tw.step(i) as s:
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.loss(loss)

    for i in range(3):  # warm-up outside the sync check (the probe's first run included)
        step(i)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(3, 10):
            step(i)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    tw.shutdown()
    steps = {s["step"]: s for s in transport.steps()}
    assert sorted(s for s in steps if "probe" in s) == [0, 3, 6, 9]
    model.eval()
    with torch.no_grad():
        want = hex_words(fingerprint([model(fixed)]).tolist())
    assert steps[9]["probe"] == want
    assert len(steps[9]["probe_sums"]) == 3 and len(steps[9]["fingerprint"]) == 32
