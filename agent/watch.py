"""``tw.watch(model, optimizer)``: automatic phase timing, grad norm and the DDP comm split.

Hooks take a timestamp and append it to the step in progress (``Recorder.current``,
:mod:`.step`):

- the model's forward pre-hook starts ``forward``; its forward hook starts ``backward``
  (which therefore holds the loss computation and the wait for the last gradient
  buckets: the communication split below tells those apart);
- the optimizer's step pre-hook starts ``optimizer``; its post-hook starts ``other``.

With ``grad_norm=True`` the optimizer's pre-hook also queues the global gradient norm's
computation on the device, never waiting for it; under a ``loss_spike`` drill two more
optimizer hooks scale one update, under an ``sdc`` drill one flips a parameter bit
(:mod:`.drills`).

Replica check (:mod:`.replica`): when the model has a replica group, the post-hook that
starts ``other`` also, at steps whose number is a multiple of ``replica_check_every``,
queues the parameters' fingerprint on the device and captures it as the loss is
(:func:`.values.capture_ints`); the exporter thread reads it. Every other step pays one
modulo and one comparison.

For ``DistributedDataParallel``, a communication hook records when each gradient
bucket is ready and when its collective completes. It wraps the default allreduce,
or the user's hook: if the user registers one after ``tw.watch``, it is chained
inside ours, never replaced. A hook registered *before* ``tw.watch`` cannot be
wrapped (DDP takes one hook); then the always-on split is off and a warning says so.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .probe import Probe
from .replica import fingerprint, replica_group_of
from .values import Captured, capture, capture_ints
from .watch_options import determinism_probe_every as _determinism_probe_every
from .watch_options import probe_rtol as _probe_rtol
from .watch_options import replica_check_every as _replica_check_every

if TYPE_CHECKING:
    from .core import Agent
    from .drills import Drill
    from .step import Recorder

log = logging.getLogger(__name__)


class Watch:
    """What ``tw.watch`` installed; ``remove()`` takes the hooks off again (not the comm hook)."""

    def __init__(self) -> None:
        self.handles: list[Any] = []
        self.comm_hook = False
        self.replica_check_every = 0
        """Steps between replica checks; 0: no check (off, no optimizer, or no replica)."""
        self.replica_group: str | None = None
        """This rank's replica group as the collector gets it (``"0-7"``), when checked."""
        self.determinism_probe_every = 0
        """Steps between determinism probes (:mod:`.probe`); 0: no probe."""
        self.probe_rtol = 0.0

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _mark(recorder: Recorder, name: str) -> Callable[..., None]:
    def hook(*_args: Any) -> None:
        record = recorder.current
        if record is not None:
            record.mark(name)

    return hook


def _grad_norm_hook(recorder: Recorder, optimizer: Any) -> Callable[..., None]:
    import torch

    mark = _mark(recorder, "optimizer")

    def hook(*_args: Any) -> None:
        mark()
        record = recorder.current
        if record is None or record.grad_norm is not None:
            return
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        if not grads:
            return
        # On-device: foreach norms then the norm of norms; queued, never synced here.
        norms = torch._foreach_norm(grads)
        total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
        record.grad_norm = capture(total)

    return hook


def _replica_hook(recorder: Recorder, model: Any, every: int, group: str) -> Callable[..., None]:
    """The optimizer's post-hook: starts ``other``; at a checked step, also queues the
    fingerprint of the parameters as they are after the update."""

    def hook(*_args: Any) -> None:
        record = recorder.current
        if record is None:
            return
        record.mark("other")
        if record.step % every:  # an unchecked step: this comparison is all it pays
            return
        # Kernels queued on the device, a non_blocking copy to the host: no sync here.
        record.replica = (capture_ints(fingerprint(model.parameters())), group)

    return hook


def _probe_hook(
    recorder: Recorder,
    model: Any,
    every: int,
    group: str,
    probe: Probe,
    probe_every: int,
    rtol: float,
) -> Callable[..., None]:
    """The optimizer's post-hook with the determinism probe on: starts ``other``; at a
    checked step queues the parameters' fingerprint, at a probed step also runs the probe
    (:mod:`.probe`). A probed step is always a checked step too."""

    def hook(*_args: Any) -> None:
        record = recorder.current
        if record is None:
            return
        record.mark("other")
        step = record.step
        probed = step % probe_every == 0
        if not probed and (not every or step % every):
            return
        record.replica = (capture_ints(fingerprint(model.parameters())), group)
        if not probed or probe.args is None:
            if probed and probe.unusable is not None:
                record.probe = (Captured(issue=probe.unusable), rtol)
            return
        marks = len(record.phases)  # the probe's forward is not the step's own
        gpu_marks = len(record.gpu.marks) if record.gpu is not None else 0
        try:
            words = probe.run()
        except Exception as exc:  # the trainer is never crashed by the agent
            probe.args, probe.unusable = None, f"the probe's forward failed: {exc!r}"[:200]
            log.warning("trainwarden: determinism probe off: %s", probe.unusable)
            record.probe = (Captured(issue=probe.unusable), rtol)
            return
        finally:
            del record.phases[marks:]
            if record.gpu is not None:
                del record.gpu.marks[gpu_marks:]
        if words is None:
            record.probe = (Captured(issue="the model's output has no floating-point tensor"), rtol)
        else:
            record.probe = (capture_ints(words), rtol)

    return hook


def _learn_probe_input(probe: Probe) -> Any:
    """Build the probe's input from the first training forward (a pre-hook that removes
    itself after it ran once); returns its handle."""
    handle: Any = None

    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        handle.remove()
        if probe.needs_input:
            probe.learn_input(args, kwargs)

    handle = probe.module.register_forward_pre_hook(hook, with_kwargs=True)
    return handle


def _arith_drill_hook(agent: Agent, drill: Drill, probe_module: Any) -> Any:
    """The ``sdc=arith`` drill: from step S on, this rank's forward output is one unit in
    the last place off (:func:`.drills.nudge_output`), in training and in the probe."""
    from .drills import nudge_output

    recorder = agent.recorder

    def hook(_module: Any, _args: Any, output: Any) -> Any:
        record = recorder.current
        if record is None:
            return None
        fault = drill.arith(record.step)
        if fault is None:
            return None
        if drill.first_time(fault):
            agent.event(
                "drill",
                step=record.step,
                severity="warning",
                fault="sdc",
                form="arith",
                spec=fault.text,
            )
        return nudge_output(output)

    return probe_module.register_forward_hook(hook)


def _sdc_drill_hook(agent: Agent, drill: Drill, model: Any) -> Callable[..., None]:
    """The ``sdc=bitflip`` drill: right after this rank's optimizer step at S, one bit of
    one parameter flips (:func:`.drills.flip_bit`), before the step's fingerprint."""
    from .drills import flip_bit

    recorder = agent.recorder

    def post(*_args: Any) -> None:
        record = recorder.current
        fault = None if record is None else drill.bitflip(record.step)
        if record is None or fault is None:
            return
        flipped = flip_bit(model)
        if flipped is None:
            agent.event(
                "drill",
                step=record.step,
                severity="warning",
                fault="sdc",
                form="bitflip",
                spec=fault.text,
                skipped="no parameter requires grad",
            )
            return
        name, element, bit = flipped
        log.warning(
            "trainwarden drill: flipped bit %d of element %d of parameter %s after step %d",
            bit,
            element,
            name,
            record.step,
        )
        agent.event(
            "drill",
            step=record.step,
            severity="warning",
            fault="sdc",
            form="bitflip",
            spec=fault.text,
            parameter=name,
            element=element,
            bit=bit,
        )

    return post


def _spike_drill_hooks(agent: Agent, drill: Drill, optimizer: Any) -> list[Any]:
    """The loss_spike drill: scale one optimizer update by the drill's factor.

    The parameters are saved before the step and moved ``factor`` x as far as the
    optimizer moved them, which works for any optimizer (Adam normalizes a scaled
    gradient away, so scaling gradients would not do).
    """
    import torch

    saved: list[Any] = []

    recorder = agent.recorder

    def pre(*_args: Any) -> None:
        record = recorder.current
        scale = None if record is None else drill.update_scale(record.step)
        if record is None or scale is None:
            return
        agent.event("drill", step=record.step, severity="warning", fault="loss_spike", scale=scale)
        with torch.no_grad():
            params = [p for g in optimizer.param_groups for p in g["params"]]
            saved[:] = [(scale, params, [p.detach().clone() for p in params])]

    def post(*_args: Any) -> None:
        if not saved:
            return
        scale, params, before = saved.pop()
        with torch.no_grad():
            for p, old in zip(params, before, strict=True):
                p.copy_(old + scale * (p - old))

    return [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]


def install_comm_hook(recorder: Recorder, ddp: Any) -> bool:
    """Time every gradient bucket's collective; returns False if DDP already had a hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if getattr(ddp, "_comm_hooks", None):
        log.warning(
            "trainwarden: this DDP model already has a comm hook, which cannot be wrapped; "
            "call tw.watch() before register_comm_hook() to get the always-on comm split"
        )
        return False
    inner: list[Any] = [default_hooks.allreduce_hook, ddp.process_group]
    perf = time.perf_counter_ns

    # No annotations: DDP checks them, and this module's are strings.
    def hook(_state, bucket):  # type: ignore[no-untyped-def]
        record = recorder.current
        ready = perf()
        clock = None if record is None else record.gpu
        ready_on_gpu = None if clock is None else clock.now()  # the bucket's gradients are done
        future = inner[0](inner[1], bucket)
        if record is None:
            return future
        intervals = record.comm

        def done(fut: Any) -> Any:  # runs on the communication thread
            intervals.append((ready, perf()))
            if ready_on_gpu is not None:
                # A CUDA future's callback runs on a stream made to wait for the
                # collective: this event completes when the collective has.
                done_on_gpu = clock.now()
                if done_on_gpu is not None:
                    clock.comm.append((ready_on_gpu, done_on_gpu))
            return fut.value()

        return future.then(done)

    ddp.register_comm_hook(None, hook)

    def register_comm_hook(state: object, user_hook: Callable[..., Any]) -> None:
        """Chains the user's hook inside trainwarden's instead of replacing it."""
        inner[:] = [user_hook, state]

    ddp.register_comm_hook = register_comm_hook
    return True


def watch(
    agent: Agent,
    model: Any,
    optimizer: Any = None,
    *,
    grad_norm: bool = False,
    comm: bool = True,
    count_flops: bool | None = None,
    replica_check_every: int | None = None,
    replica_group: Any = None,
    determinism_probe_every: int | None = None,
    probe_input: Any = None,
    probe_rtol: float | None = None,
) -> Watch:
    import torch

    every = _replica_check_every(replica_check_every)  # ConfigError now, not at step 100
    probe_every = _determinism_probe_every(determinism_probe_every)
    rtol = _probe_rtol(probe_rtol)
    recorder = agent.recorder  # the hooks write into the step in progress
    installed = Watch()
    installed.handles.append(model.register_forward_pre_hook(_mark(recorder, "forward")))
    installed.handles.append(model.register_forward_hook(_mark(recorder, "backward")))
    if optimizer is not None:
        pre = _grad_norm_hook(recorder, optimizer) if grad_norm else _mark(recorder, "optimizer")
        installed.handles.append(optimizer.register_step_pre_hook(pre))
        if agent.drill is not None:
            # Before the post-hook below: a drill's change is in the step's fingerprint.
            installed.handles.extend(_spike_drill_hooks(agent, agent.drill, optimizer))
            if any(f.form == "bitflip" for f in agent.drill.faults):
                sdc = _sdc_drill_hook(agent, agent.drill, model)
                installed.handles.append(optimizer.register_step_post_hook(sdc))
        checked = every or probe_every
        group = replica_group_of(model, replica_group, rank=agent.config.rank) if checked else None
        if group is not None and probe_every:
            installed.replica_check_every, installed.replica_group = every, group[0]
            installed.determinism_probe_every, installed.probe_rtol = probe_every, rtol
            probe = Probe(model, probe_input)
            if probe.needs_input:
                installed.handles.append(_learn_probe_input(probe))
            post = _probe_hook(recorder, model, every, group[0], probe, probe_every, rtol)
        elif group is not None:
            installed.replica_check_every, installed.replica_group = every, group[0]
            post = _replica_hook(recorder, model, every, group[0])
        else:
            post = _mark(recorder, "other")
        installed.handles.append(optimizer.register_step_post_hook(post))
    elif grad_norm:
        raise ValueError(
            "tw.watch(model, grad_norm=True) needs the optimizer: tw.watch(model, optimizer, ...)"
        )
    if agent.drill is not None and any(f.form == "arith" for f in agent.drill.faults):
        from .probe import inner_module

        installed.handles.append(_arith_drill_hook(agent, agent.drill, inner_module(model)))
    if comm and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        installed.comm_hook = install_comm_hook(recorder, model)
    if count_flops is None:
        count_flops = agent.flop_model.source is None
    if count_flops:
        agent.count_flops_on_next_step()
    return installed
