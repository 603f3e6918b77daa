from __future__ import annotations

import pytest
import torch
from torch import nn

from trainwarden.agent.mfu import count_flops, dtype_name, measure_cpu_peak, mfu, peak_for


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.5e12),
        ("NVIDIA H100 NVL", "fp16", 835.5e12),
        ("NVIDIA H200", "bf16", 989.5e12),
        ("NVIDIA H200 NVL", "bf16", 835.5e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA B200", "fp8", 4500e12),
        ("NVIDIA GB200", "bf16", 2500e12),
        ("NVIDIA L40S", "bf16", 362.05e12),
        ("NVIDIA L4", "fp32", 30.3e12),
        ("AMD Instinct MI300X", "bf16", 1307.4e12),
    ],
)
def test_peak_table_names_the_device_and_its_source(device: str, dtype, expected: float) -> None:
    peak = peak_for(device, dtype)
    assert peak is not None and peak.flops == expected
    assert peak.source.startswith("table: ") and "datasheet" in peak.source


def test_unknown_device_and_dtype() -> None:
    assert peak_for("Some Future GPU", "bf16") is None
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_name("int3")


def test_automatic_flop_count_matches_the_hand_count_of_an_mlp() -> None:
    batch, d_in, d_hidden, d_out = 32, 256, 512, 128
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.ReLU(), nn.Linear(d_hidden, d_out))
    x = torch.randn(batch, d_in)

    def step() -> None:
        model(x).sum().backward()

    matmul = 2 * batch * (d_in * d_hidden + d_hidden * d_out)  # forward
    # backward: grad wrt weights for both layers, grad wrt input only for the second
    # (the first layer's input does not require grad)
    hand = matmul + 2 * batch * (d_in * d_hidden + d_hidden * d_out) + 2 * batch * d_hidden * d_out
    assert count_flops(step) == hand


def test_cpu_peak_is_measured_and_labelled() -> None:
    peak = measure_cpu_peak(min_time_s=0.05, size=128)
    assert peak.flops > 1e8
    assert peak.source.startswith("measured: cpu float32 matmul")


def test_mfu_formula() -> None:
    assert mfu(1e12, 0.5, 4e12) == 0.5
    assert mfu(1e12, 0.0, 4e12) is None
