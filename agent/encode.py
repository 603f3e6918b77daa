"""Turn a finished step record into its wire form. Runs on the exporter thread, in step order.

This is where the deferred work happens: tensor values (and a replica check's
fingerprint) are read, phases and the compute / communication split are computed from
timestamps, MFU is derived, and the spike detector sees each value once.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

from . import device_clock
from .datafeed import DataFeed
from .mfu import Peak, mfu
from .probe import decode
from .profiler import split_from_profile
from .replica import hex_words
from .samples import summarize as summarize_samples
from .spikes import SpikeDetector
from .timing import phase_durations, split_from_hook
from .values import NOT_READY, issue_of, json_number, resolve, resolve_ints

_PHASE_KEYS = {"forward": "fwd_s", "backward": "bwd_s", "optimizer": "opt_s", "other": "other_s"}
_SPLIT_KEYS = {
    "compute": "compute_s",
    "exposed_comm": "exposed_comm_s",
    "overlapped_comm": "overlapped_comm_s",
    "idle": "idle_s",
}


@dataclass
class FlopModel:
    """How many model FLOPs a step does, and where that number comes from."""

    per_step: float | None = None
    per_token: float | None = None
    source: str | None = None

    def flops(self, tokens: int | None) -> float | None:
        if self.per_token is not None and tokens is not None:
            return self.per_token * tokens
        return self.per_step


def _rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS; the peak RSS of this process.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class StepEncoder:
    def __init__(self, *, spikes: SpikeDetector, flop_model: FlopModel, peak: Peak | None) -> None:
        self.spikes = spikes
        self.flop_model = flop_model
        self.peak = peak
        self.data: DataFeed | None = None  # the dataset's sample for coverage (datafeed.py)
        self._rss_at = 0.0
        self._rss_value = 0
        self._previous_gpu_end: Any = None  # the last step's end event on the GPU's clock

    def _rss(self) -> int:
        # Peak RSS changes slowly: one system call per second is plenty.
        now = time.monotonic()
        if now - self._rss_at > 1.0:
            self._rss_value, self._rss_at = _rss_bytes(), now
        return self._rss_value

    @staticmethod
    def _values(
        metrics: dict[str, Any], issues: dict[str, str], *, force: bool, prefix: str = ""
    ) -> dict[str, float | str | None] | None:
        """``s.metric`` (``prefix`` ``user.``) or built-in (``s.lr``) values as wire numbers;
        ``None`` while one is in flight (unless ``force``)."""
        out: dict[str, float | str | None] = {}
        for name, captured in metrics.items():
            value = resolve(captured)
            if value is NOT_READY:
                if not force:
                    return None
                value, issues[prefix + name] = None, "device copy did not complete"
            elif (why := issue_of(captured)) is not None:
                issues[prefix + name] = why
            out[name] = json_number(value)
        return out

    def __call__(self, record: Any, *, force: bool) -> dict[str, Any] | None:
        """The JSON body of ``record``; ``None`` while a device value is in flight (unless
        ``force``)."""
        loss = resolve(record.loss)
        grad = resolve(record.grad_norm)
        issues: dict[str, str] = {}
        if loss is NOT_READY or grad is NOT_READY:
            if not force:
                return None
            if loss is NOT_READY:
                loss, issues["loss"] = None, "device copy did not complete"
            if grad is NOT_READY:
                grad, issues["grad_norm"] = None, "device copy did not complete"
        for name, captured in (("loss", record.loss), ("grad_norm", record.grad_norm)):
            if (why := issue_of(captured)) is not None:
                issues[name] = why
        replica = None
        if record.replica is not None:  # a replica-checked step (tw.watch, replica.py)
            captured, group = record.replica
            words = resolve_ints(captured)
            if words is NOT_READY:
                if not force:
                    return None
                issues["fingerprint"] = "device copy did not complete"
            elif isinstance(words, list):
                replica = (hex_words(words), group)
        probe = None
        if record.probe is not None:  # a probed step (tw.watch, probe.py)
            captured, rtol = record.probe
            words = resolve_ints(captured)
            if words is NOT_READY:
                if not force:
                    return None
                issues["probe"] = "device copy did not complete"
            elif isinstance(words, list):
                probe = probe_fields(words, rtol, issues)
            elif captured.issue is not None:
                issues["probe"] = captured.issue
        samples = None
        if record.samples is not None:  # s.samples(ids): samples.py
            data = self.data
            try:
                samples = summarize_samples(record.samples, None if data is None else data.universe)
            except OverflowError:
                issues["samples"] = "an id outside int64"
            else:
                if samples is None:
                    if not force:
                        return None
                    issues["samples"] = "device copy did not complete"
        user = given = None
        if record.metrics is not None:
            user = self._values(record.metrics, issues, force=force, prefix="user.")
            if user is None:
                return None
        if record.given is not None:
            given = self._values(record.given, issues, force=force)
            if given is None:
                return None
        if record.error is not None:
            issues["exception"] = record.error
        if record.note is not None:
            issues["timing"] = record.note

        start = record.start_ns
        duration_ns, data_wait_ns = record.duration_ns, record.data_wait_ns
        phases, comm = record.phases, record.comm
        if record.gpu is not None:  # the GPU's clock (device_clock.py)
            if device_clock.ready(record.gpu):
                try:
                    timing = device_clock.read(record.gpu, self._previous_gpu_end)
                    marks = [
                        (n, start + at)
                        for (n, _), at in zip(phases, timing.marks_ns, strict=True)
                        if at is not None
                    ]
                except (RuntimeError, ValueError) as exc:  # e.g. events on two GPUs: host times
                    issues["step_time"] = f"GPU events unreadable ({exc}): host times"[:200]
                else:
                    duration_ns, data_wait_ns = timing.duration_ns, timing.gap_ns
                    phases = marks
                    comm = [(start + a, start + b) for a, b in timing.comm]
                settled = record.gpu.settled
                self._previous_gpu_end = record.gpu.end if settled is None else settled
            elif not force:
                return None
            else:
                issues["step_time"] = "GPU events did not complete: host times"
                self._previous_gpu_end = None
        duration = duration_ns / 1e9
        out: dict[str, Any] = {
            "step": record.step,
            "ts": record.wall_start_ns / 1e9,
            "duration_s": duration,
            "data_wait_s": None if data_wait_ns is None else data_wait_ns / 1e9,
            "tokens": record.tokens,
            "loss": json_number(loss),
            "grad_norm": json_number(grad),
        }
        end = start + duration_ns
        if phases:
            for name, ns in phase_durations(phases, start, end).items():
                if name in _PHASE_KEYS:
                    out[_PHASE_KEYS[name]] = ns / 1e9
        split, source = None, "profiler"
        if record.profile is not None:
            split = split_from_profile(record.profile)
            record.profile = None  # the trace is not kept
            if split is not None:
                # The profiler's window also holds the agent's own entry and exit around
                # the step; scale its split to the step's measured duration.
                window = split["compute"] + split["exposed_comm"] + split["idle"]
                if window > 0:
                    scale = duration_ns / window
                    split = {name: round(ns * scale) for name, ns in split.items()}
        if split is None:
            split, source = split_from_hook(comm, start, end), "hook"
        if split is not None:
            for name, ns in split.items():
                out[_SPLIT_KEYS[name]] = ns / 1e9
            out["comm_source"] = source

        flops = record.flops if record.flops is not None else self.flop_model.flops(record.tokens)
        if flops is not None:
            out["flops"] = flops
            out["flops_source"] = (
                "counted this step" if record.flops is not None else self.flop_model.source
            )
            if self.peak is not None and record.note is None:  # a counted step is slowed: no MFU
                out["mfu"] = mfu(flops, duration, self.peak.flops)
                out["peak_flops"] = self.peak.flops
                out["peak_source"] = self.peak.source
        elif self.flop_model.per_token is not None and record.tokens is None:
            issues["mfu"] = "no tokens given: flops_per_token needs tw.step(..., tokens=n)"

        if replica is not None:
            out["fingerprint"], out["replica_group"] = replica
            if probe is not None:
                out.update(probe)

        if samples is not None:
            out["samples_digest"], out["samples_count"], kept = samples
            if record.epoch is not None:
                out["samples_epoch"] = record.epoch
            if kept is not None:
                out["samples_kept"] = kept
        if record.sources:
            out["data_sources"] = record.sources

        if record.memory is not None:
            out["mem_allocated_bytes"], out["mem_reserved_bytes"] = record.memory
        else:
            out["rss_bytes"] = self._rss()

        flags = self.spikes.observe(
            loss=loss if isinstance(loss, float) and not record.error else None,
            grad_norm=grad if isinstance(grad, float) else None,
        )
        if flags:
            out["flags"] = flags
        if given:
            out.update(given)
        if user:
            out["metrics"] = user
        if issues:
            out["issues"] = issues
        return out


def probe_fields(words: list[int], rtol: float, issues: dict[str, str]) -> dict[str, Any]:
    """A probe's words as the step's fields: ``probe`` (32 hex digits), ``probe_sums``
    (3 floats; left out, with an issue, when the output was not finite) and, when
    comparisons are not bit-exact, ``probe_rtol``."""
    bits, sums = decode(words)
    out: dict[str, Any] = {"probe": hex_words(bits)}
    if all(math.isfinite(v) for v in sums):
        out["probe_sums"] = sums
    else:
        issues["probe"] = "output not finite: compared bit-exactly"
    if rtol:
        out["probe_rtol"] = rtol
    return out
