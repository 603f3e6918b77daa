"""Model FLOPs utilization: model FLOPs per step / (step time x peak FLOP/s).

Peaks are dense (no 2:4 sparsity) tensor-core figures per GPU from the vendors'
datasheets; every MFU figure is stored with the peak and the FLOP source it used, so
a number can always be traced back. On a CPU there is no honest table: the peak must
be given, or it is measured with a short matmul and labelled ``measured``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_DTYPE_NAMES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp16": "fp16",
    "float8": "fp8",
    "fp8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "tf32": "tf32",
    "float32": "fp32",
    "float": "fp32",
    "fp32": "fp32",
}

# (substring of the device name as NVML / torch.cuda.get_device_name report it,
#  label, {dtype: dense FLOP/s}, source). Checked in order: most specific first.
_T = 1e12
PEAKS: list[tuple[str, str, dict[str, float], str]] = [
    (
        "GB200",
        "NVIDIA GB200 (per Blackwell GPU)",
        {
            "fp8": 5000 * _T,
            "bf16": 2500 * _T,
            "fp16": 2500 * _T,
            "tf32": 1250 * _T,
            "fp32": 80 * _T,
        },
        "GB200 NVL72 datasheet: 360 PF bf16 sparse / 72 GPUs / 2 (dense)",
    ),
    (
        "B200",
        "NVIDIA B200",
        {
            "fp8": 4500 * _T,
            "bf16": 2250 * _T,
            "fp16": 2250 * _T,
            "tf32": 1125 * _T,
            "fp32": 75 * _T,
        },
        "HGX B200 datasheet: 36 PF bf16 sparse / 8 GPUs / 2 (dense)",
    ),
    (
        "H200 NVL",
        "NVIDIA H200 NVL",
        {
            "fp8": 1671 * _T,
            "bf16": 835.5 * _T,
            "fp16": 835.5 * _T,
            "tf32": 417.5 * _T,
            "fp32": 60 * _T,
        },
        "H200 NVL datasheet: 1,671 TF bf16 sparse / 2 (dense)",
    ),
    (
        "H200",
        "NVIDIA H200 SXM",
        {
            "fp8": 1979 * _T,
            "bf16": 989.5 * _T,
            "fp16": 989.5 * _T,
            "tf32": 494.5 * _T,
            "fp32": 67 * _T,
        },
        "H200 SXM datasheet: 1,979 TF bf16 sparse / 2 (dense)",
    ),
    (
        "H100 NVL",
        "NVIDIA H100 NVL",
        {
            "fp8": 1670.5 * _T,
            "bf16": 835.5 * _T,
            "fp16": 835.5 * _T,
            "tf32": 417.5 * _T,
            "fp32": 60 * _T,
        },
        "H100 NVL datasheet: 1,671 TF bf16 sparse / 2 (dense)",
    ),
    (
        "H100 PCIe",
        "NVIDIA H100 PCIe",
        {
            "fp8": 1513 * _T,
            "bf16": 756.5 * _T,
            "fp16": 756.5 * _T,
            "tf32": 378 * _T,
            "fp32": 51 * _T,
        },
        "H100 PCIe datasheet: 1,513 TF bf16 sparse / 2 (dense)",
    ),
    (
        "H100",
        "NVIDIA H100 SXM",
        {
            "fp8": 1979 * _T,
            "bf16": 989.4 * _T,
            "fp16": 989.4 * _T,
            "tf32": 494.7 * _T,
            "fp32": 66.9 * _T,
        },
        "H100 SXM datasheet: 1,979 TF bf16 sparse / 2 (dense)",
    ),
    (
        "A100",
        "NVIDIA A100",
        {"bf16": 312 * _T, "fp16": 312 * _T, "tf32": 156 * _T, "fp32": 19.5 * _T},
        "A100 datasheet: 312 TF bf16 dense",
    ),
    (
        "L40S",
        "NVIDIA L40S",
        {
            "fp8": 733 * _T,
            "bf16": 362.05 * _T,
            "fp16": 362.05 * _T,
            "tf32": 183 * _T,
            "fp32": 91.6 * _T,
        },
        "L40S datasheet: 733 TF bf16 sparse / 2 (dense)",
    ),
    (
        "L4",
        "NVIDIA L4",
        {"fp8": 242.5 * _T, "bf16": 121 * _T, "fp16": 121 * _T, "tf32": 60 * _T, "fp32": 30.3 * _T},
        "L4 datasheet: 242 TF bf16 sparse / 2 (dense)",
    ),
    (
        "MI300X",
        "AMD Instinct MI300X",
        {
            "fp8": 2614.9 * _T,
            "bf16": 1307.4 * _T,
            "fp16": 1307.4 * _T,
            "tf32": 653.7 * _T,
            "fp32": 163.4 * _T,
        },
        "MI300X datasheet: 1,307.4 TF bf16 dense",
    ),
]


@dataclass(frozen=True)
class Peak:
    flops: float
    """Peak FLOP/s of one device."""
    source: str
    """Where the number comes from: ``given``, ``table: ...`` or ``measured: ...``."""


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` / ``"bfloat16"`` / ``"bf16"`` -> ``"bf16"``."""
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of bf16, fp16, fp8, tf32, fp32")
    return _DTYPE_NAMES[key]


def peak_for(device_name: str, dtype: Any = "bf16") -> Peak | None:
    """The datasheet peak of ``device_name`` for ``dtype``, or ``None`` if not in the table."""
    kind = dtype_name(dtype)
    for needle, label, peaks, source in PEAKS:
        if needle.lower() in device_name.lower() and kind in peaks:
            return Peak(peaks[kind], f"table: {label} {kind} dense ({source})")
    return None


def measure_cpu_peak(*, dtype: Any = None, size: int = 512, min_time_s: float = 0.3) -> Peak:
    """Measure this CPU's matmul FLOP/s (the best of several timed runs)."""
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm up
    best, deadline = 0.0, time.perf_counter() + min_time_s
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - t0))
    threads = torch.get_num_threads()
    return Peak(
        best,
        f"measured: cpu {str(dtype).removeprefix('torch.')} matmul {size}^3, {threads} threads",
    )


def count_flops(fn: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of one call of ``fn`` (e.g. a forward + backward), by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())


def mfu(flops: float, seconds: float, peak_flops: float) -> float | None:
    if not seconds or not peak_flops:
        return None
    return flops / (seconds * peak_flops)


def resolve_peak(
    dtype: Any = "bf16", *, local_rank: int = 0, cuda: bool | None = None
) -> Peak | None:
    """This process's device peak: the table entry for its GPU, else a CPU measurement.

    ``cuda``: whether the trainer runs on the GPU (the agent's answer: it has initialized
    CUDA); ``None`` asks whether a GPU is there at all.
    """
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        name = (
            torch.cuda.get_device_name()  # the trainer's current device
            if torch.cuda.is_initialized()
            else torch.cuda.get_device_name(local_rank % torch.cuda.device_count())
        )
        peak = peak_for(name, dtype)
        if peak is None:
            log.warning(
                "trainwarden: no peak FLOP/s known for %r (%s); pass tw.init(peak_flops=...) "
                "to get MFU",
                name,
                dtype_name(dtype),
            )
        return peak
    return measure_cpu_peak()
