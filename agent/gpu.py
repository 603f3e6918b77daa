"""GPU health on the agent: an NVML sampler and an XID watcher, each on its own thread.

Both talk to a *device* with two methods, ``sample()`` and ``wait_xid(timeout_ms)``:
:class:`NvmlDevice` is the real GPU through nvidia-ml-py; :class:`SimulatedDevice`
stands in for it where there is none, and is what drills inject XIDs and thermal
throttles into, so that those faults travel the same path as real ones.

A field the GPU or driver does not support is left out of the sample, never an
error. No NVML (no driver, no GPU): one ``gpu_telemetry`` event that says so, once.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

log = logging.getLogger(__name__)

THROTTLE_REASONS = {  # NVML clocks-event reason bits -> names
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "power_brake",
}
RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
}
XID_SEVERITY = {
    "ignore": "info",
    "restart_app": "warning",
    "reset_gpu": "critical",
    "reboot_node": "critical",
    "drain": "critical",
}


@functools.cache
def xid_catalog() -> dict[int, dict[str, str]]:
    """XID code -> {name, meaning, action}; ranges like "144-150" are expanded."""
    raw = json.loads(
        resources.files("trainwarden.agent").joinpath("data/xid_catalog.json").read_text()
    )
    out: dict[int, dict[str, str]] = {}
    for key, entry in raw.items():
        if key.startswith("_"):
            continue
        low, _, high = key.partition("-")
        for code in range(int(low), int(high or low) + 1):
            out[code] = entry
    return out


def describe_xid(code: int) -> dict[str, str]:
    return xid_catalog().get(
        code,
        {
            "name": f"XID {code}",
            "meaning": "Not in trainwarden's catalog: see NVIDIA's XID catalog.",
            "action": "restart_app",
        },
    )


class NvmlDevice:
    """This rank's real GPU through NVML."""

    simulated = False

    def __init__(self, local_rank: int) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()
        self.handle = self._find_handle(local_rank)
        self.uuid = _text(pynvml.nvmlDeviceGetUUID(self.handle))
        self.name = _text(pynvml.nvmlDeviceGetName(self.handle))
        self._events: Any = None

    def _find_handle(self, local_rank: int) -> Any:
        """This rank's GPU. NVML ignores CUDA_VISIBLE_DEVICES and numbers the GPUs its own
        way: match the trainer's device by UUID if it has initialized CUDA (the agent never
        does), else read CUDA_VISIBLE_DEVICES (indices or UUIDs) for local rank's GPU."""
        n = self._nvml
        torch = sys.modules.get("torch")
        try:
            if torch is not None and torch.cuda.is_initialized():
                uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
                return n.nvmlDeviceGetHandleByUUID(
                    uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
                )
        except Exception:
            pass
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        visible = [v for v in visible if v]
        if visible:
            chosen = visible[local_rank % len(visible)]
            if chosen.isdigit():
                return n.nvmlDeviceGetHandleByIndex(int(chosen))
            return n.nvmlDeviceGetHandleByUUID(chosen)
        return n.nvmlDeviceGetHandleByIndex(local_rank % max(1, n.nvmlDeviceGetCount()))

    def _get(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(self.handle, *args)
        except self._nvml.NVMLError:  # not supported on this GPU or driver: leave it out
            return None

    def sample(self) -> dict[str, Any]:
        n = self._nvml
        out: dict[str, Any] = {"gpu_uuid": self.uuid, "gpu_name": self.name}
        out["temp_c"] = self._get(n.nvmlDeviceGetTemperature, n.NVML_TEMPERATURE_GPU)
        fields = self._get(
            n.nvmlDeviceGetFieldValues,
            [n.NVML_FI_DEV_MEMORY_TEMP, n.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION],
        )
        if fields:
            mem_temp, recovery = fields
            if mem_temp.nvmlReturn == n.NVML_SUCCESS:
                out["mem_temp_c"] = float(mem_temp.value.uiVal)
            if recovery.nvmlReturn == n.NVML_SUCCESS:
                out["recovery_action"] = RECOVERY_ACTIONS.get(
                    recovery.value.uiVal, str(recovery.value.uiVal)
                )
        power = self._get(n.nvmlDeviceGetPowerUsage)
        limit = self._get(n.nvmlDeviceGetEnforcedPowerLimit)
        out["power_w"] = None if power is None else power / 1000
        out["power_limit_w"] = None if limit is None else limit / 1000
        out["sm_clock_mhz"] = self._get(n.nvmlDeviceGetClockInfo, n.NVML_CLOCK_SM)
        out["sm_clock_max_mhz"] = self._get(n.nvmlDeviceGetMaxClockInfo, n.NVML_CLOCK_SM)
        reasons = self._get(n.nvmlDeviceGetCurrentClocksEventReasons)
        if reasons is not None:
            out["throttle"] = [name for bit, name in THROTTLE_REASONS.items() if reasons & bit]
        util = self._get(n.nvmlDeviceGetUtilizationRates)
        if util is not None:
            out["util_gpu"], out["util_mem"] = float(util.gpu), float(util.memory)
        memory = self._get(n.nvmlDeviceGetMemoryInfo)
        if memory is not None:
            out["mem_used_bytes"], out["mem_total_bytes"] = int(memory.used), int(memory.total)
        out["ecc_corrected"] = self._get(
            n.nvmlDeviceGetTotalEccErrors, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC
        )
        out["ecc_uncorrected"] = self._get(
            n.nvmlDeviceGetTotalEccErrors, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
        )
        retired = [
            self._get(n.nvmlDeviceGetRetiredPages, cause)
            for cause in (
                n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
            )
        ]
        if any(r is not None for r in retired):
            out["retired_pages"] = sum(len(r) for r in retired if r is not None)
        remapped = self._get(n.nvmlDeviceGetRemappedRows)
        if remapped is not None:
            corr, unc, pending, _failure = remapped
            out["remapped_rows_correctable"], out["remapped_rows_uncorrectable"] = (
                int(corr),
                int(unc),
            )
            out["remap_pending"] = bool(pending)
        out["pcie_replay"] = self._get(n.nvmlDeviceGetPcieReplayCounter)
        return {k: v for k, v in out.items() if v is not None}

    def wait_xid(self, timeout_ms: int) -> int | None:
        n = self._nvml
        if self._events is None:
            self._events = n.nvmlEventSetCreate()
            n.nvmlDeviceRegisterEvents(self.handle, n.nvmlEventTypeXidCriticalError, self._events)
        try:
            data = n.nvmlEventSetWait_v2(self._events, timeout_ms)
        except n.NVMLError_Timeout:
            return None
        return int(data.eventData)

    def close(self) -> None:
        try:
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class SimulatedDevice:
    """A GPU that is not there: plausible idle readings, and faults injected by drills."""

    simulated = True

    def __init__(self, local_rank: int, *, name: str = "Simulated GPU") -> None:
        self.uuid = f"GPU-sim-{os.getpid()}-{local_rank}"
        self.name = name
        self.temp_c = 45.0
        self.throttle: list[str] = []
        self.sm_clock_mhz = 1980.0
        self._xids: queue.Queue[int] = queue.Queue()

    def inject_xid(self, code: int) -> None:
        self._xids.put(code)

    def set_thermal(self, temp_c: float) -> None:
        """Overheat: throttles the clocks the way the driver does (thermal slowdown)."""
        self.temp_c = temp_c
        self.throttle = ["sw_thermal", "hw_thermal"] if temp_c >= 85 else []
        self.sm_clock_mhz = 1980.0 * (0.6 if self.throttle else 1.0)

    def sample(self) -> dict[str, Any]:
        return {
            "gpu_uuid": self.uuid,
            "gpu_name": self.name,
            "temp_c": self.temp_c,
            "power_w": 120.0,
            "power_limit_w": 700.0,
            "sm_clock_mhz": self.sm_clock_mhz,
            "sm_clock_max_mhz": 1980.0,
            "throttle": list(self.throttle),
            "ecc_corrected": 0,
            "ecc_uncorrected": 0,
        }

    def wait_xid(self, timeout_ms: int) -> int | None:
        try:
            return self._xids.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


def open_device(local_rank: int, *, simulate: bool) -> tuple[Any, str | None]:
    """(device, None), or (None, why there is no GPU telemetry)."""
    if simulate:
        return SimulatedDevice(local_rank), None
    try:
        return NvmlDevice(local_rank), None
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    except Exception as exc:
        return None, f"NVML unavailable: {exc}"


class GpuMonitor:
    """Two daemon threads: the sampler (every ``interval_s``) and the XID watcher."""

    def __init__(
        self,
        device: Any,
        *,
        interval_s: float,
        on_sample: Callable[[dict[str, Any]], None],
        on_xid: Callable[[int], None],
    ) -> None:
        self.device = device
        self.interval_s = interval_s
        self._on_sample = on_sample
        self._on_xid = on_xid
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._sample_loop, name="trainwarden-nvml", daemon=True),
            threading.Thread(target=self._xid_loop, name="trainwarden-xid", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def sample_now(self) -> None:
        try:
            self._on_sample(
                {"ts": time.time(), **self.device.sample(), "simulated": self.device.simulated}
            )
        except Exception:
            log.exception("trainwarden: GPU sample failed")

    def _sample_loop(self) -> None:
        self.sample_now()
        while not self._stop.wait(self.interval_s):
            self.sample_now()

    def _xid_loop(self) -> None:
        while not self._stop.is_set():
            try:
                code = self.device.wait_xid(500)
            except Exception:
                log.exception("trainwarden: XID watcher failed; it stops")
                return
            if code is not None:
                self._on_xid(code)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(2)
        self.device.close()
