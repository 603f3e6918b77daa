"""Read scalar telemetry (loss, grad norm) without stalling the training thread.

The training thread calls :func:`capture`, which never synchronizes with a device:
a CUDA tensor is copied device-to-host with ``non_blocking=True`` and a CUDA event is
recorded behind the copy. The exporter thread later calls :func:`resolve`, which
returns the value once the event has completed and says "not yet" otherwise.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

USER_METRIC_NAME = r"^[a-z][a-z0-9_.]{0,31}$"
"""What a user metric may be called (``s.metric(name, ...)``): the collector checks the same."""
MAX_USER_METRICS = 32
"""User metrics per step, at most."""
_user_name = re.compile(USER_METRIC_NAME).match
_checked_names: set[str] = set()  # names seen valid: checked once a process, not per step


def check_metric_name(name: str, count: int) -> None:
    """Raise ``ValueError`` naming a bad user metric ``name`` (``count``: those the step has)."""
    if name not in _checked_names:
        if not isinstance(name, str) or not _user_name(name):
            raise ValueError(
                f"user metric name {name!r} must match {USER_METRIC_NAME} "
                "(lower case, digits, '_' and '.'; at most 32 characters)"
            )
        _checked_names.add(name)
    if count >= MAX_USER_METRICS:
        raise ValueError(f"user metric {name!r} is one too many: at most {MAX_USER_METRICS} a step")


NOT_READY = object()
"""Returned by :func:`resolve` while a device copy is still in flight."""


class Captured:
    """A value taken on the training thread, read later on the exporter thread."""

    __slots__ = ("tensor", "event", "issue")

    def __init__(self, tensor: Any = None, event: Any = None, issue: str | None = None) -> None:
        self.tensor = tensor
        self.event = event
        self.issue = issue


def capture(value: Any) -> float | Captured | None:
    """Take ``value`` (a number or a tensor) on the training thread. Never syncs.

    Returns a float for plain numbers, a :class:`Captured` for tensors, ``None`` for
    ``None``. A tensor with no elements is captured as an issue, not an error.
    """
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        try:
            return float(value)  # numpy scalars and friends
        except (TypeError, ValueError):
            return Captured(issue=f"not a number or tensor: {type(value).__name__}")
    if value.numel() == 0:  # metadata only, no sync
        return Captured(issue="empty tensor")
    tensor = value.detach()
    if tensor.numel() != 1:
        tensor = tensor.float().mean()  # queued on the tensor's stream; no sync
    if tensor.device.type == "cuda":
        # non_blocking D2H lands in pinned memory; the event tells the exporter when.
        host = tensor.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Captured(host, event)
    return Captured(tensor)


def resolve(captured: float | Captured | None) -> Any:
    """On the exporter thread: the float value, ``None``, or :data:`NOT_READY`."""
    if captured is None or isinstance(captured, float):
        return captured
    if captured.issue is not None:
        return None
    if captured.event is not None and not captured.event.query():
        return NOT_READY
    return float(captured.tensor.item())


def capture_ints(tensor: Any) -> Captured:
    """Take a small integer tensor (a fingerprint's words) on the training thread, as
    :func:`capture` takes a loss: a CUDA tensor is copied to the host ``non_blocking``
    behind an event recorded on its device's stream; a CPU tensor is kept as it is. Never
    syncs."""
    tensor = tensor.detach()
    if tensor.device.type == "cuda":
        torch = sys.modules["torch"]
        host = tensor.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return Captured(host, event)
    return Captured(tensor)


def resolve_ints(captured: Captured) -> list[int] | None | object:
    """On the exporter thread: the integers of :func:`capture_ints`, or :data:`NOT_READY`."""
    if captured.issue is not None:
        return None
    if captured.event is not None and not captured.event.query():
        return NOT_READY
    return [int(v) for v in captured.tensor.reshape(-1).tolist()]


def resolve_now(captured: Captured) -> float | None:
    """Read a captured value at once. **Synchronizes** with the device: not for telemetry."""
    if captured.issue is not None:
        return None
    if captured.event is not None:
        captured.event.synchronize()
    return float(captured.tensor.item())


def issue_of(captured: float | Captured | None) -> str | None:
    """Why a captured value has no number (empty tensor, non-finite), else ``None``."""
    if isinstance(captured, Captured):
        return captured.issue
    return None


def json_number(value: float | None) -> float | str | None:
    """JSON has no NaN/Inf: send them as the strings the collector understands."""
    if value is None or math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"
