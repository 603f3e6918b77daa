"""The agent's preflight (``agent/preflight.py``, ``tw.init(preflight=True)``) on this
machine's CPU: what it measures, what the drill does to it, and how it is asked for; on a
GPU (scripts/gpu_check.sh, no conftest there), its bf16 GEMM and NVML reads."""

from __future__ import annotations

import pytest
import torch

import trainwarden.agent as tw
from trainwarden.agent import preflight
from trainwarden.agent.config import AgentConfig

from .helpers import RecordingTransport


def test_a_cpu_preflight_measures_gemm_and_copy_and_names_no_fault() -> None:
    got = preflight.measure()
    assert (got["device"], got["dtype"], got["gemm_n"]) == ("cpu", "float32", 384)
    assert got["gemm_flops"] > 1e8 and got["copy_bytes_per_s"] > 1e8
    assert got["allreduce_bytes_per_s"] is None and got["group_size"] is None  # no group
    assert (got["nvml"], got["faults"]) == (None, [])
    assert 0 < got["took_s"] < 30


def test_the_drill_really_slows_the_checks_or_adds_a_simulated_fault() -> None:
    fine, slow = preflight.measure(), preflight.measure(drill="slow")
    assert slow["gemm_flops"] < 0.75 * fine["gemm_flops"], (slow, fine)
    assert slow["copy_bytes_per_s"] < 0.8 * fine["copy_bytes_per_s"], (slow, fine)
    assert slow["drill"] == "preflight=slow"
    faulty = preflight.measure(drill="ecc")
    assert faulty["faults"] == ["1 uncorrectable ECC error (simulated: preflight=ecc drill)"]


@pytest.mark.usefixtures("clean_agent")
def test_preflight_runs_at_the_first_step_and_is_sent_as_an_event() -> None:
    transport = RecordingTransport()
    tw.init(run="pre", transport=transport, gpu_interval_s=0, preflight=True)
    with tw.step(0):
        pass
    tw.shutdown()
    (event,) = [e for e in transport.events() if e["kind"] == "preflight"]
    assert event["severity"] == "info" and event["data"]["gemm_flops"] > 0
    assert event["step"] is None


@pytest.mark.usefixtures("clean_agent")
@pytest.mark.parametrize(("value", "on"), [("1", True), ("yes", True), ("off", False), ("", False)])
def test_the_variable_turns_it_on_and_off(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    monkeypatch.setenv("TRAINWARDEN_PREFLIGHT", value)
    assert AgentConfig.resolve(run="r").preflight is on


@pytest.mark.usefixtures("clean_agent")
def test_a_wrong_value_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWARDEN_PREFLIGHT", "sometimes")
    with pytest.raises(tw.ConfigError, match="preflight .TRAINWARDEN_PREFLIGHT. must be yes or no"):
        AgentConfig.resolve(run="r")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_gpu_preflight_runs_bf16_gemm_and_reads_nvml_within_15_s() -> None:
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the trainer's first CUDA work: the device is in use
    got = preflight.measure()
    assert got["device"] != "cpu" and got["dtype"] == "bfloat16" and got["gemm_n"] == 8192
    assert got["gemm_flops"] > 1e13  # a datacenter GPU's bf16 GEMM: tens of TFLOP/s at least
    assert got["copy_bytes_per_s"] > 1e11
    nvml = got["nvml"]
    assert nvml is not None and "error" not in nvml, nvml
    assert nvml["pcie_width"] and nvml["pcie_max_width"], nvml
    assert got["took_s"] < 15, got
    print("GPU preflight:", {k: v for k, v in got.items() if k != "nvml"}, "nvml:", nvml)
