"""Fault drills: inject real faults through the code paths real faults take.

``TRAINWARDEN_DRILL`` (or ``tw.init(drill=...)``) holds faults separated by ``;``::

    xid=79@rank=1,step=40            an XID raised by this rank's (simulated) GPU
    thermal=92C@rank=0,step=20       the GPU heats to 92 C and throttles its clocks
    slow=1.5x@rank=1,steps=10-60     the rank's steps really take 1.5x as long
    hang@rank=1,step=50,for=30s      the training thread stops; heartbeats go on
    die@rank=1,step=70               the process exits (code 75) without a goodbye; on
                                     the job's first attempt only (a launcher's restart,
                                     torchrun's or Slurm's, resumes past it; sdc= too:
                                     the faulty GPU stays behind)
    die@rank=1,step=33,nth=2         nth=N (with step=S): the Nth time the process
                                     starts step S, e.g. its run again after a rollback
    die@rank=1,step=20,attempts=all  in every attempt: the launcher's restarts die at
                                     the same step again (a crash loop)
    desync@rank=1,step=60,for=60s    the rank issues an extra, empty all_reduce: its
                                     collectives are one sequence id ahead of its
                                     peers', so every rank blocks on gloo (for= 60s
                                     by default, then the rank exits with code 75, as a
                                     watchdog would end it)
    loss_spike=50x@step=35           the optimizer's update is scaled 50x (all ranks
                                     unless rank= is given); needs tw.watch(model, opt)
    sdc=bitflip@rank=1,step=35       silent data corruption: right after its optimizer
                                     step at 35, the rank flips one bit of one parameter
                                     element; needs tw.watch(model, opt)
    data=same_batch@step=20          from step 20 on, every rank trains on rank 0's batch
                                     (a sampler that ignores the rank): the trainer
                                     makes it (the demo trainer does); the agent records
                                     the drill event; needs s.samples(ids) to be found
    preflight=slow@rank=2            tw.init(preflight=True)'s checks before step 0:
                                     the rank's GEMM and memory copy really run twice
                                     per one counted (half its peers' speed); =ecc: an
                                     uncorrectable ECC error, simulated (named so)
    data=forget_sampler_state        a resume restarts the sampler from its seed (the
                                     demo trainer's data cursor goes back to batch 0);
                                     @step=0 is accepted too (no other step means more)
    sdc=arith@rank=1,step=20         wrong arithmetic: from step 20 on, the rank's
                                     forward output is one unit in the last place off
                                     (what the determinism probe finds); needs tw.watch

An XID or a thermal fault runs through the GPU layer: without a real GPU the agent
then uses a simulated one. Every injected fault is also recorded as a ``drill`` event.

``desync`` is a collective mismatch: at the start of step S, rank R calls
``torch.distributed.all_reduce`` on an empty float32 tensor (default group). The
Flight Recorder records it as the next sequence id with size ``[[0]]`` while the peers
record their real collective there, so the collector sees a desync. On gloo no data
moves for an empty tensor (a real size mismatch would abort the process instead), and
the rank's next real collective waits for a sequence id its peers never issue: every
rank blocks, as on NCCL in a real mismatch. The drill's own timer stands in for the
NCCL watchdog: after ``for`` seconds the rank records a ``drill`` event with
``timed_out: true`` and exits with code 75; the peers then fail on the broken
connection. On NCCL the drill is weaker: NCCL itself drops a collective of 0 elements
(it moves nothing and pairs with nothing), so the ranks go on; only the recorder's
sequence ids stay one apart, until the timer ends the rank and the peers wait for it
(NCCL's own timeout).

``sdc=bitflip`` flips, on rank R right after its optimizer step
at S (an optimizer step post-hook of ``tw.watch``, before that step's replica
fingerprint), the highest mantissa bit of element 0 of the model's first parameter
that requires grad (``model.named_parameters()`` order), in place: bit 22 of a float32,
6 of a bf16, 9 of an fp16, 51 of a float64. The exponent is untouched, so the value
stays finite and moves by up to half its magnitude: a real divergence, no NaN. DDP
never broadcasts parameters again after its construction, so the replica stays
diverged while training goes on; every later replica check shows it. The ``drill``
event names the parameter, the element and the bit.

``sdc=arith`` stands for a GPU whose arithmetic is wrong while its memory is right: from
step S on, a forward hook of ``tw.watch`` on the model (inside a DDP wrapper: its
module) moves element 0 of each floating-point output tensor of rank R one unit in the
last place up (``torch.nextafter`` towards +inf), in every forward, the training one and
the determinism probe's (:mod:`.probe`). Gradients flow through unchanged; DDP averages
the slightly wrong gradient into every replica, so their parameters stay equal: only the
probe sees it. One ``drill`` event at the first nudged forward.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from .identity import attempt_key

log = logging.getLogger(__name__)

DIE_EXIT_CODE = 75
DESYNC_FOR_S = 60.0
"""How long a ``desync`` rank waits in the mismatched collective before it exits."""
KINDS = (
    "xid",
    "thermal",
    "slow",
    "hang",
    "die",
    "desync",
    "loss_spike",
    "sdc",
    "data",
    "preflight",
)
SDC_FORMS = ("bitflip", "arith")
DATA_FORMS = ("same_batch", "forget_sampler_state")
PREFLIGHT_FORMS = ("slow", "ecc")
"""What ``data=`` takes (made by the trainer): every rank on rank 0's batch; a resume that
restarts the sampler from its seed."""
"""What ``sdc=`` takes: a flipped parameter bit, or a perturbed forward output."""
_VALUE = {
    "xid": (re.compile(r"^\d+$"), "an XID code, e.g. xid=79"),
    "thermal": (re.compile(r"^\d+(\.\d+)?C$"), "a temperature in C, e.g. thermal=92C"),
    "slow": (re.compile(r"^\d+(\.\d+)?x$"), "a slowdown factor, e.g. slow=1.5x"),
    "loss_spike": (re.compile(r"^\d+(\.\d+)?x$"), "an update scale, e.g. loss_spike=50x"),
}
_AT_STEP_START = ("xid", "thermal", "hang", "die", "desync")
"""The faults a step's start triggers (:meth:`Drill.on_step_start`)."""
_PARAMS = {"rank", "step", "steps", "for", "nth", "attempts"}


class DrillError(ValueError):
    """The drill spec is wrong; the message names the fault and says how to write it."""


@dataclass(frozen=True)
class Fault:
    kind: str
    text: str
    value: float | None = None
    rank: int | None = None  # None: every rank
    first: int = 0
    last: int | None = None  # inclusive; None: only ``first`` (or open-ended for thermal)
    seconds: float | None = None
    form: str | None = None  # sdc's: bitflip or arith
    nth: int = 1  # the nth time the process starts step ``first`` (a replay after a rollback)
    every_attempt: bool = False  # die: also in the launcher's restarts (attempts=all)

    def covers(self, step: int) -> bool:
        if self.last is None:
            return step == self.first
        return self.first <= step <= self.last


def parse(spec: str) -> list[Fault]:
    faults = []
    for part in (p.strip() for p in spec.split(";")):
        if part:
            faults.append(_parse_one(part))
    return faults


def _parse_one(text: str) -> Fault:
    def fail(why: str) -> DrillError:
        return DrillError(
            f"drill {text!r}: {why}. Form: KIND[=VALUE]@rank=R,step=S (see the README)"
        )

    head, at, tail = text.partition("@")
    if not at and head.replace(" ", "") == "data=forget_sampler_state":
        tail = "step=0"  # it acts on the next resume, whatever the step: no step to give
    elif not at:
        raise fail("missing '@' before the rank / step")
    kind, _, value = head.partition("=")
    kind = kind.strip()
    if kind not in KINDS:
        raise fail(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
    number: float | None = None
    form = None
    if kind == "sdc":
        form = value.strip()
        if form not in SDC_FORMS:
            raise fail(f"sdc needs its form: sdc=bitflip or sdc=arith, got {form!r}")
    elif kind == "preflight":
        form = value.strip()
        if form not in PREFLIGHT_FORMS:
            raise fail(f"preflight needs its form: preflight=slow or preflight=ecc, got {form!r}")
        if "step" not in tail and "steps" not in tail:
            tail += ",step=0"  # before step 0: no step to give
    elif kind == "data":
        form = value.strip()
        if form not in DATA_FORMS:
            raise fail(
                f"data needs its form: data=same_batch or data=forget_sampler_state, got {form!r}"
            )
    elif kind in _VALUE:
        pattern, example = _VALUE[kind]
        if not pattern.match(value.strip()):
            raise fail(f"{kind} needs {example}")
        number = float(value.strip().rstrip("Cx"))
        if not math.isfinite(number):
            raise fail(f"{kind} needs a finite number, e.g. {example.split('e.g. ')[-1]}")
        if kind in ("slow", "loss_spike") and number <= 0:
            raise fail(f"{kind} factor must be positive")
        if kind == "xid" and number < 1:
            raise fail("an XID code is 1 or more, e.g. xid=79")
    elif value:
        raise fail(f"{kind} takes no value")
    params: dict[str, str] = {}
    for item in tail.split(","):
        key, eq, val = item.strip().partition("=")
        if not eq or key not in _PARAMS:
            raise fail(
                f"bad parameter {item.strip()!r}; use rank=, step=, steps=A-B, for=30s, nth=N, "
                "attempts=all"
            )
        params[key] = val.strip()
    try:
        rank = int(params["rank"]) if "rank" in params else None
        if "steps" in params:
            low, _, high = params["steps"].partition("-")
            first, last = int(low), int(high)
            if last < first:
                raise fail("steps=A-B needs A <= B")
        elif "step" in params:
            first, last = int(params["step"]), None
        else:
            raise fail("say when: step=S or steps=A-B")
        seconds = float(params["for"].rstrip("s")) if "for" in params else None
        nth = int(params.get("nth", "1"))
        if nth < 1:
            raise ValueError("nth")
        if min(first, rank or 0) < 0 or (last is not None and last < 0):
            raise ValueError("negative")
        if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
            raise ValueError("not a duration")
    except DrillError:
        raise
    except ValueError:
        raise fail(
            "rank, step and steps take integers >= 0, nth one >= 1; for takes seconds like 30s"
        ) from None
    if params.get("attempts", "first") not in ("first", "all"):
        raise fail("attempts= takes first (the default) or all")
    every_attempt = params.get("attempts") == "all"
    if every_attempt and kind != "die":
        raise fail("attempts= is die's only")
    if nth > 1 and (last is not None or kind not in _AT_STEP_START):
        raise fail(
            f"nth=N takes one step (step=S) of a fault at a step's start "
            f"({', '.join(_AT_STEP_START)})"
        )
    if kind in ("xid", "thermal", "slow", "hang", "die", "desync", "sdc", "preflight") and (
        rank is None
    ):
        raise fail(f"{kind} needs rank=R (which rank fails)")
    if kind == "hang" and seconds is None:
        raise fail("hang needs for=DURATION, e.g. for=30s")
    if kind == "sdc" and last is not None:
        raise fail("sdc takes step=S (bitflip: once; arith: from S on), not steps=A-B")
    if kind == "sdc" and seconds is not None:
        raise fail("sdc takes no for=: the flipped bit stays")
    if kind == "desync":
        if last is not None:
            raise fail("desync happens once: step=S, not steps=A-B")
        seconds = DESYNC_FOR_S if seconds is None else seconds
    if kind == "thermal" and last is None:
        last = 2**62  # stays hot from that step on
    if form in ("arith", "same_batch"):
        if last is not None:
            raise fail(f"{kind}={form} lasts from step=S on, not steps=A-B")
        last = 2**62  # wrong from that step on
    return Fault(kind, text, number, rank, first, last, seconds, form, nth, every_attempt)


class DrillHost(Protocol):
    """What a drill's faults act on (the agent): its events, its flush, its GPU."""

    gpu_device: Any  # a simulated one when the drill needs a GPU and there is none
    gpu_monitor: Any

    def event(
        self, kind: str, *, step: int | None = None, severity: str = "info", **data: Any
    ) -> None: ...

    def flush(self, timeout_s: float) -> None: ...


class Drill:
    """The faults that apply to this rank, triggered at step boundaries (:mod:`.rare`)
    and, for ``loss_spike`` and ``sdc``, from the optimizer hooks of ``tw.watch``."""

    def __init__(self, faults: list[Fault], *, rank: int, world_size: int) -> None:
        for fault in faults:
            if fault.rank is not None and fault.rank >= world_size:
                raise DrillError(
                    f"drill {fault.text!r}: rank {fault.rank} is outside world_size {world_size}"
                )
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self.needs_gpu = any(f.kind in ("xid", "thermal") for f in self.faults)
        self._fired: set[tuple[str, int]] = set()
        self._starts: dict[int, int] = {}  # how often a step an nth= fault waits on began
        self._counted = {f.first for f in self.faults if f.nth > 1}

    def _once(self, fault: Fault, step: int) -> bool:
        key = (fault.text, step if fault.kind == "slow" else fault.first)
        if key in self._fired:
            return False
        self._fired.add(key)
        return True

    def on_step_start(self, agent: DrillHost, step: int) -> None:
        """Before the step's work: XID, thermal, hang, die, desync."""
        if step in self._counted:
            self._starts[step] = self._starts.get(step, 0) + 1
        for fault in self.faults:
            if (
                not fault.covers(step)
                or fault.kind in ("slow", "loss_spike", "sdc", "preflight")
                or (fault.nth > 1 and self._starts.get(step) != fault.nth)
                or not self._once(fault, step)
            ):
                continue
            if fault.kind == "die" and restarted() and not fault.every_attempt:
                log.warning("trainwarden drill: %s skipped: the job was restarted", fault.text)
                continue
            dist, skipped = _peers() if fault.kind == "desync" else (None, None)
            extra = {"skipped": skipped} if skipped else {}
            agent.event(
                "drill", step=step, severity="warning", fault=fault.kind, spec=fault.text, **extra
            )
            if fault.kind == "xid":
                agent.gpu_device.inject_xid(int(fault.value or 0))
            elif fault.kind == "thermal":
                agent.gpu_device.set_thermal(float(fault.value or 0))
                # The driver's view changes now, not at the next tick.
                agent.gpu_monitor.sample_now()
            elif fault.kind == "hang":
                log.warning(
                    "trainwarden drill: hanging the training thread for %.0fs", fault.seconds
                )
                time.sleep(fault.seconds or 0.0)
            elif fault.kind == "die":
                log.warning("trainwarden drill: this process exits now (code %d)", DIE_EXIT_CODE)
                agent.flush(timeout_s=2.0)  # the drill event, so the post-mortem shows the cause
                os._exit(DIE_EXIT_CODE)
            elif fault.kind == "desync":
                if dist is None:
                    log.warning("trainwarden drill: %s skipped: %s", fault.text, skipped)
                    continue
                _desync(agent, dist, fault, step)

    def preflight(self) -> str | None:
        """The ``preflight=`` fault of this rank (``slow``: its checks take twice as long;
        ``ecc``: a simulated uncorrectable ECC error), on the job's first attempt only."""
        for fault in self.faults:
            if fault.kind == "preflight":
                return None if restarted() else fault.form
        return None

    def slowdown(self, step: int) -> float | None:
        for fault in self.faults:
            if fault.kind == "slow" and fault.covers(step):
                return fault.value
        return None

    def bitflip(self, step: int) -> Fault | None:
        """The ``sdc=bitflip`` fault due after this step's optimizer step, once; on the
        job's first attempt only (the faulty GPU stays behind when the job restarts)."""
        for fault in self.faults:
            if fault.form == "bitflip" and fault.covers(step) and self._once(fault, step):
                return None if restarted() else fault
        return None

    def arith(self, step: int) -> Fault | None:
        """The ``sdc=arith`` fault in force at this step (every forward from S on), on the
        job's first attempt only."""
        for fault in self.faults:
            if fault.form == "arith" and fault.covers(step):
                return None if restarted() else fault
        return None

    def first_time(self, fault: Fault) -> bool:
        """True once per fault: for the one ``drill`` event of a lasting fault."""
        return self._once(fault, fault.first)

    def update_scale(self, step: int) -> float | None:
        for fault in self.faults:
            if fault.kind == "loss_spike" and fault.covers(step) and self._once(fault, step):
                return fault.value
        return None


MANTISSA_TOP_BIT = {"float32": 22, "bfloat16": 6, "float16": 9, "float64": 51}
"""The bit ``sdc=bitflip`` flips, per dtype: the highest mantissa bit (never the
exponent: the value stays finite). Other dtypes: bit 0 of the element's raw bits."""


def flip_bit(model: Any) -> tuple[str, int, int] | None:
    """Flip one bit of element 0 of ``model``'s first parameter that requires grad, in
    place (its local shard for a DTensor); returns (parameter name, element, bit), or
    None when no parameter requires grad. Queued on the device: no sync."""
    import torch

    from .replica import local_tensor

    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        local = local_tensor(param)  # shares the parameter's storage
        if local.numel() == 0:
            continue
        bit = MANTISSA_TOP_BIT.get(str(local.dtype).removeprefix("torch."), 0)
        size = local.element_size()
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}.get(size, torch.int64)
        with torch.no_grad():
            bits = local.view(ints)
            first = bits[(0,) * bits.dim()]  # a view of element 0, contiguous or not
            first.bitwise_xor_(1 << bit)
        return name, 0, bit
    return None


def nudge_output(output: Any) -> Any:
    """``output`` with element 0 of each floating-point tensor moved one unit in the last
    place towards +inf (tuples, lists and dicts rebuilt around them; anything else as it
    was). Autograd flows through unchanged: the nudge is a constant added."""
    import torch

    if isinstance(output, torch.Tensor):
        if not output.is_floating_point() or output.numel() == 0:
            return output
        with torch.no_grad():
            first = output.reshape(-1)[:1]
            step = torch.nextafter(first, torch.full_like(first, math.inf)) - first
            delta = torch.zeros(output.shape, dtype=output.dtype, device=output.device)
            delta.view(-1)[:1] = torch.where(torch.isfinite(step), step, 0.0)
        return output + delta
    if isinstance(output, dict):
        rebuilt = {k: nudge_output(v) for k, v in output.items()}
        try:
            return type(output)(rebuilt)
        except TypeError:
            return rebuilt
    if isinstance(output, tuple) and hasattr(output, "_fields"):  # a namedtuple
        return type(output)(*(nudge_output(v) for v in output))
    if isinstance(output, (list, tuple)):
        return type(output)(nudge_output(v) for v in output)
    return output


def _peers() -> tuple[Any, str | None]:
    """``torch.distributed`` when a desync can be made (a default group with peers), else
    (None, why not)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None, "torch is not installed: no collective to desync"
    if not dist.is_available() or not dist.is_initialized():
        return None, "torch.distributed is not initialized: no collective to desync"
    if dist.get_world_size() < 2:
        return None, "the default process group has one rank: no peer to desync from"
    return dist, None


def _desync(agent: DrillHost, dist: Any, fault: Fault, step: int) -> None:
    """Issue an empty all_reduce on the default group (training thread), with the timer
    that ends this rank if the collectives stay stuck (a watchdog's part)."""
    import torch

    seconds = fault.seconds or DESYNC_FOR_S
    agent.flush(timeout_s=2.0)  # the drill event reaches the collector before all blocks
    timer = threading.Timer(seconds, _desync_timed_out, args=(agent, fault, step, seconds))
    timer.name = "trainwarden-drill-desync"
    timer.daemon = True  # never keeps a finished trainer alive
    timer.start()
    # NCCL takes CUDA tensors only; gloo (and a cpu:gloo,cuda:nccl group) takes this one.
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    )
    log.warning(
        "trainwarden drill: an empty all_reduce on the default group at step %d; the ranks "
        "will wait for each other, and this one exits in %.0fs (code %d)",
        step,
        seconds,
        DIE_EXIT_CODE,
    )
    dist.all_reduce(torch.zeros(0, dtype=torch.float32, device=device))


def _desync_timed_out(agent: DrillHost, fault: Fault, step: int, seconds: float) -> None:
    log.warning(
        "trainwarden drill: the desynced collectives timed out after %.0fs; this process "
        "exits now (code %d)",
        seconds,
        DIE_EXIT_CODE,
    )
    agent.event(
        "drill",
        step=step,
        severity="warning",
        fault=fault.kind,
        spec=fault.text,
        timed_out=True,
        after_s=seconds,
    )
    agent.flush(timeout_s=2.0)
    os._exit(DIE_EXIT_CODE)


def restarted() -> bool:
    """Whether the launcher restarted this job (torchrun's or Slurm's restart count > 0):
    a ``die`` drill then does not fire again, as a transient fault would not."""
    return bool(attempt_key()[1])
