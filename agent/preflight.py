"""Preflight: before step 0, check what this rank trains on (``tw.init(preflight=True)``,
``TRAINWARDEN_PREFLIGHT=1``).

On the training thread, at the first step's entry, bounded (about 1-2 s on a CPU, well
under 15 s on a GPU):

- **compute**: a timed GEMM on the rank's device (bf16, 8192² on a GPU; fp32, 384² on a
  CPU): achieved FLOP/s, against the declared peak when one is known;
- **memory**: a large device copy (1 GiB on a GPU, 32 MiB on a CPU): bytes moved a second;
  on a CPU both run on one thread and count this process's CPU time, so that a host whose
  cores the job's other ranks share does not make one rank look slow;
- **the collective path**: with a process group, a timed all-reduce of 32 MiB over the
  job's default group (every rank runs it at its first step, so the collectives pair up):
  the bytes a second each rank saw;
- **NVML**, on a GPU: uncorrectable ECC errors, pending row remaps and retired pages, the
  PCIe link's width and generation against its maximum (a downgraded link is a silent
  slowdown), and the clock throttle reasons that hold the clocks down.

The result is a ``preflight`` event of the rank; the collector compares the ranks and
nodes (``collector/health/preflight.py``) and pages PreflightFailed on an outlier (under
0.85x the median) or a hard fault. A drill makes one rank slow or faulty
(``preflight=slow@rank=R``, ``preflight=ecc@rank=R``: a stand-in, named as simulated).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)

ALLREDUCE_BYTES = 32 << 20
CPU_GEMM_N, GPU_GEMM_N = 384, 8192
CPU_COPY_BYTES, GPU_COPY_BYTES = 32 << 20, 1 << 30
MIN_TIMED_S = 0.2  # a CPU measure repeats its work for at least this long
MAX_TURNS = 16  # CPU ranks of a group this size or smaller measure one after another
NVML_THROTTLES = {  # the throttle reasons that hold clocks down for a fault, not for idling
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}


def _timed(work: Any, sync: Any, clock: Any, *, repeat: int = 1) -> float:
    """Run ``work`` in rounds until ``MIN_TIMED_S`` has passed on ``clock`` (``repeat``
    times a counted round: the drill's slowdown); the shortest round's seconds: what the
    device does when nothing else is in its way (a busy moment slows a round, never
    speeds one up)."""
    work()  # warm up: allocation, kernels, caches
    sync()
    rounds, best, started = 0, float("inf"), clock()
    while True:
        begun = clock()
        for _ in range(repeat):
            work()
        sync()
        ended = clock()
        rounds, best = rounds + 1, min(best, ended - begun)
        if ended - started >= MIN_TIMED_S and rounds >= 5 and best > 0:
            return best


def _device(torch: Any) -> Any:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _nvml(index: int) -> tuple[dict[str, Any], list[str]]:
    """What NVML says of GPU ``index``: its facts and the hard faults among them."""
    import pynvml  # nvidia-ml-py: there on a GPU node

    facts: dict[str, Any] = {}
    faults: list[str] = []
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)

        def read(name: str, call: Any) -> Any:
            try:
                facts[name] = call()
            except pynvml.NVMLError:
                facts[name] = None
            return facts[name]

        ecc = read(
            "ecc_uncorrected",
            lambda: pynvml.nvmlDeviceGetTotalEccErrors(
                h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
            ),
        )
        if ecc:
            faults.append(f"{ecc} uncorrectable ECC errors since the driver loaded")
        remap = read("remapped_rows", lambda: list(pynvml.nvmlDeviceGetRemappedRows(h)))
        if remap and len(remap) >= 4 and (remap[2] or remap[3]):
            faults.append("a row remap is pending or failed: the GPU needs a reset")
        pages = read(
            "retired_pages_pending",
            lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h),
        )
        if pages:
            faults.append("retired pages are pending: the GPU needs a reset")
        width = read("pcie_width", lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(h))
        max_width = read("pcie_max_width", lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(h))
        gen = read("pcie_gen", lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h))
        max_gen = read("pcie_max_gen", lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h))
        if width and max_width and width < max_width:
            faults.append(f"PCIe link at x{width} of x{max_width}")
        if gen and max_gen and gen < max_gen:
            faults.append(f"PCIe link at gen {gen} of gen {max_gen}")
        reasons = read(
            "throttle_reasons", lambda: pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        )
        held = [why for bit, why in NVML_THROTTLES.items() if reasons and reasons & bit]
        if held:
            faults.append("clocks held down: " + ", ".join(held))
    finally:
        pynvml.nvmlShutdown()
    return facts, faults


def _gemm_flops(
    torch: Any, device: Any, n: int, dtype: Any, sync: Any, clock: Any, repeat: int
) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _timed(lambda: torch.mm(a, b), sync, clock, repeat=repeat)


def _copy_bytes_per_s(
    torch: Any, device: Any, size: int, sync: Any, clock: Any, repeat: int
) -> float:
    src = torch.empty(size // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * size / _timed(lambda: dst.copy_(src), sync, clock, repeat=repeat)  # read, written


def measure(*, drill: str | None = None, peak_flops: float | None = None) -> dict[str, Any]:
    """This rank's preflight: the event's data (see the module's docstring)."""
    import torch

    started = time.perf_counter()
    device = _device(torch)
    on_gpu = device.type == "cuda"
    repeat = 2 if drill == "slow" else 1
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu else (lambda: None)

    n = GPU_GEMM_N if on_gpu else CPU_GEMM_N
    dtype = torch.bfloat16 if on_gpu else torch.float32
    # On a CPU, the time this process ran: a host whose cores other processes share (the
    # job's other ranks among them) does not make the rank look slow; on a GPU, the wall.
    # One thread: a core's rate, comparable between ranks whatever their thread pools.
    clock = time.perf_counter if on_gpu else time.process_time
    dist = torch.distributed
    grouped = dist.is_available() and dist.is_initialized()
    # On CPUs the ranks of a host share its memory bus (and SMT siblings a core): with a
    # group of a test's size they take turns, so that each measures alone.
    turns = not on_gpu and grouped and dist.get_world_size() <= MAX_TURNS
    threads = torch.get_num_threads()
    if not on_gpu:
        torch.set_num_threads(1)
    try:
        for turn in range(dist.get_world_size() if turns else 1):
            if not turns or turn == dist.get_rank():
                gemm = _gemm_flops(torch, device, n, dtype, sync, clock, repeat)
                size = GPU_COPY_BYTES if on_gpu else CPU_COPY_BYTES
                copy = _copy_bytes_per_s(torch, device, size, sync, clock, repeat)
            if turns:
                dist.barrier()
    finally:
        torch.set_num_threads(threads)

    allreduce = group = None
    if grouped:
        group = dist.get_world_size()
        buf = torch.ones(ALLREDUCE_BYTES // 4, device=device, dtype=torch.float32)
        dist.all_reduce(buf)  # warm up: the connections
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            dist.all_reduce(buf)
        sync()
        allreduce = 3 * ALLREDUCE_BYTES / (time.perf_counter() - t0)
        del buf

    nvml: dict[str, Any] | None = None
    faults: list[str] = []
    if on_gpu:
        try:
            nvml, faults = _nvml(device.index or 0)
        except Exception as exc:  # no NVML on this node: the measures stand
            nvml = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    if drill == "ecc":
        faults.append("1 uncorrectable ECC error (simulated: preflight=ecc drill)")
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "gemm_n": n,
        "gemm_flops": gemm,
        "peak_flops": peak_flops,
        "copy_bytes_per_s": copy,
        "allreduce_bytes": ALLREDUCE_BYTES if allreduce is not None else None,
        "allreduce_bytes_per_s": allreduce,
        "group_size": group,
        "nvml": nvml,
        "faults": faults,
        "took_s": round(time.perf_counter() - started, 3),
    }
    if drill:
        out["drill"] = f"preflight={drill}"
    return out
