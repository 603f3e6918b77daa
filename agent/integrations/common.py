"""What the framework integrations share.

- :data:`TESTED`: the framework versions the integrations were tested with, the ranges
  of the extras in ``pyproject.toml`` (a test keeps the two the same); :func:`check_version`
  says when the installed one is outside its range.
- :func:`start`: ``tw.init`` from the framework's facts (a run name, its config), unless
  the trainer started the agent itself; no collector URL, no run name, or a framework
  outside the tested range: one line at start and training goes on unobserved.
- :class:`LossTap`: each training forward's ``loss`` (a model output's ``.loss``, or a
  scalar tensor), detached and kept on its device; a step's loss is their mean, computed
  on the device (no host sync). Its forward pre-hook also counts the tokens of
  ``input_ids`` (their shape: host metadata).
- :class:`Span`: a step opened in one callback and closed in another (``tw.step``'s
  ``__enter__`` / ``__exit__``): the rollback and stop commands are applied at its close,
  the step boundary, as in a hand-written loop.
- :func:`ddp_of`: the ``DistributedDataParallel`` that wraps a module (frameworks give
  their callbacks the inner module), for the comm split's hook.
- :func:`init_process_group`: the default process group from the launcher's
  environment, surviving torchrun's restarts (the examples and the demo trainer use it).

Nothing here may crash the trainer: what fails is logged once and the integration goes
quiet.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from .. import core as _core

log = logging.getLogger("trainwarden")


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def ask_flight_recorder(init: dict[str, Any]) -> None:
    """Turn PyTorch's Flight Recorder on now (``TORCH_FR_BUFFER_SIZE``), as ``tw.init``
    would: a framework makes its process group before it calls its callbacks' hooks, and
    NCCL reads the variable when the group is made. Called when the callback is built;
    ``init={"flight_recorder_entries": 0}`` (or ``TRAINWARDEN_FLIGHT_RECORDER_ENTRIES=0``)
    leaves it off; a value the user set wins."""
    from .. import flight

    try:
        entries = init.get("flight_recorder_entries")
        if entries is None:
            entries = int(os.environ.get("TRAINWARDEN_FLIGHT_RECORDER_ENTRIES") or 2000)
        late = flight.enable(int(entries))
    except (TypeError, ValueError):
        return  # tw.init says what is wrong with it
    if late:
        log.warning(late)


TESTED = {
    "transformers": ("5.24", "6"),
    "lightning": ("2.6", "2.7"),
    "accelerate": ("1.15", "2"),
    "deepspeed": ("0.19", "0.20"),
    "ray": ("2.60", "2.61"),
    "torchtitan": ("0.3", "0.4"),
}
"""Each framework's tested range ``>=low,<high``, as the extras in ``pyproject.toml`` pin
it (CI runs transformers 5.24.0, lightning 2.6.6, accelerate 1.15.0, deepspeed
0.19.8, ray 2.60.0, torchtitan 0.3.0 (its logic only: it needs a GPU)). The integrations
hook into parts of the frameworks that are not public API (Lightning's loop counters,
the Trainer's gradient-norm method): a version outside its range is not observed."""


def check_version(framework: str, version: str) -> str | None:
    """A line saying ``version`` of ``framework`` is outside :data:`TESTED`, or None."""
    low, high = TESTED[framework]
    v = version_tuple(version)
    if version_tuple(low) <= v < version_tuple(high):
        return None
    return (
        f"trainwarden: {framework} {version} is outside the tested range >={low},<{high}: "
        "training goes on unobserved"
    )


def start(
    *,
    framework: str,
    package: str,
    version: str,
    run: str | None,
    url: str | None,
    config: Any,
    init: dict[str, Any],
    place: tuple[int, int, int] | None = None,
) -> bool:
    """Start the agent (``tw.init``) unless the trainer did; False: unobserved (said once).

    ``package`` / ``version``: the framework's, checked against :data:`TESTED` first;
    ``run``: the run name (``TRAINWARDEN_RUN`` wins); ``url``: the collector
    (``TRAINWARDEN_URL`` when None); ``config``: the framework's hyperparameters;
    ``place``: the framework's own ``(rank, world size, local rank)``, which it knows
    under any launcher (``init``'s own ``rank=`` wins)."""
    from .. import init as tw_init

    untested = check_version(package, version)
    if untested:
        log.warning(untested)
        return False
    if _core._agent is not None:
        return True
    url = url or os.environ.get("TRAINWARDEN_URL")
    if not url and init.get("transport") is None:
        log.warning(
            "trainwarden: %s: no collector URL (TRAINWARDEN_URL, or url=): training goes on "
            "unobserved",
            framework,
        )
        return False
    run = os.environ.get("TRAINWARDEN_RUN") or run
    if not run:
        log.warning(
            "trainwarden: %s: no run name (TRAINWARDEN_RUN, run=, or the framework's own) "
            "and none to derive: training goes on unobserved",
            framework,
        )
        return False
    if place is not None and init.get("rank") is None:
        init = {**init, "rank": place[0], "world_size": place[1], "local_rank": place[2]}
    try:
        tw_init(run=run, url=url, config=config, **init)
    except Exception as exc:  # a bad argument or environment: said, never raised
        log.warning(
            "trainwarden: %s: the agent did not start (%s): training goes on", framework, exc
        )
        return False
    return True


class LossTap:
    """Training forwards' losses and tokens between two :meth:`take` calls.

    A forward given ``num_items_in_batch`` (the Hugging Face Trainer's, to average the
    loss over a whole gradient-accumulation step, and by default across ranks) returns
    its own labels' loss sum divided by that count: the tap takes it back to this rank's
    mean, ``sum(loss_i * num_items_i) / sum(labels_i != -100)``, all on the device."""

    def __init__(self, module: Any) -> None:
        self._losses: list[Any] = []
        self._sums: list[tuple[Any, Any]] = []  # (loss * num_items, this forward's items)
        self._pending: tuple[Any, Any] | None = None
        self._tokens = 0
        self._module = module
        self._handles = [
            module.register_forward_pre_hook(self._before, with_kwargs=True),
            module.register_forward_hook(self._after),
        ]

    def _before(self, module: Any, args: Any, kwargs: Any) -> None:
        if not module.training:
            return
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        shape = getattr(ids, "shape", None)
        if shape is not None and len(shape) >= 1:
            n = 1
            for d in shape:
                n *= int(d)
            self._tokens += n
        items, labels = kwargs.get("num_items_in_batch"), kwargs.get("labels")
        self._pending = None
        if items is not None and labels is not None and hasattr(labels, "ne"):
            self._pending = (items, labels.ne(-100).sum())

    def _after(self, module: Any, args: Any, output: Any) -> None:
        if not module.training:
            return  # an evaluation's forward: not the step's
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is None and getattr(output, "ndim", None) == 0:
            loss = output
        pending, self._pending = self._pending, None
        if loss is None or getattr(loss, "ndim", None) != 0:
            return
        if pending is not None:
            items, mine = pending
            self._sums.append((loss.detach() * items, mine))
        else:
            self._losses.append(loss.detach())

    def take(self) -> tuple[Any, int | None]:
        """The step's loss (a 0-d tensor, on its device) and tokens; both reset."""
        losses, self._losses = self._losses, []
        sums, self._sums = self._sums, []
        tokens, self._tokens = self._tokens, 0
        loss = None
        if sums:
            import torch

            total = torch.stack([s.float() for s, _ in sums]).sum()
            count = torch.stack([torch.as_tensor(n, device=total.device) for _, n in sums]).sum()
            loss = total / count.clamp(min=1)
        elif len(losses) == 1:
            loss = losses[0]
        elif losses:
            import torch

            loss = torch.stack(losses).float().mean()
        return loss, tokens or None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def tokens_of(batch: Any) -> int | None:
    """The tokens of a batch from shapes only (host metadata): a mapping's or an
    object's ``input_ids``, the batch itself when it is a tensor, or the first element
    of a tuple or list when it is an integer tensor (token ids); else None."""
    import torch

    ids = None
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
    elif isinstance(batch, torch.Tensor):
        ids = batch
    elif isinstance(batch, (tuple, list)) and batch:
        first = batch[0]
        if isinstance(first, torch.Tensor) and not first.is_floating_point():
            ids = first
    else:
        ids = getattr(batch, "input_ids", None)
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else None


def mean_loss(losses: list[Any], scale: float = 1) -> Any:
    """The micro-batches' mean loss times ``scale``, on the device (no host sync)."""
    if not losses:
        return None
    if len(losses) == 1:
        return losses[0] * scale if scale != 1 else losses[0]
    import torch

    return torch.stack([loss.float() for loss in losses]).sum() * (scale / len(losses))


def said_rolled_back(plan: Any, path: Any, loader: str | None) -> None:
    """The log lines of a rollback an integration applied in-process (``plan``: a
    ``RollbackPlan``); ``loader``: whose data loader goes on forward (None: the loader was
    restored with the checkpoint, the integration says what that means)."""
    if loader is not None and plan.skip_to < plan.skip_from:
        log.warning(
            "trainwarden: rollback %d asks to replay the same data; %s goes on forward: "
            "later batches are trained on instead",
            plan.action,
            loader,
        )
    log.warning(
        "trainwarden: rolled back to %s (step %d) after step %d",
        path,
        plan.checkpoint_step,
        plan.barrier_step,
    )


def mark(phase: str) -> None:
    """A phase of the open step starts now (nothing when no step is open)."""
    agent = _core._agent
    record = agent.recorder.current if agent is not None else None
    if record is not None:
        record.mark(phase)


class Span:
    """A step opened by one callback and closed by another."""

    def __init__(self) -> None:
        self._step: Any = None

    @property
    def open(self) -> bool:
        return self._step is not None

    @property
    def step(self) -> Any:
        """The open step (``tw.step``'s ``Step``: ``s.metric``...), or None."""
        return self._step

    def begin(self, step: int) -> None:
        from .. import step as tw_step

        if self._step is not None:  # a step that never ended (an exception skipped it)
            self.end()
        self._step = tw_step(step)
        self._step.__enter__()

    def end_or_quiet(
        self, quiet: Callable[[Exception], None], *, loss: Any = None, tokens: int | None = None
    ) -> None:
        """:meth:`end`, where a stop's ``SystemExit`` goes on (on purpose) and any other
        failure goes to ``quiet`` (the integration goes quiet, training goes on)."""
        try:
            self.end(loss=loss, tokens=tokens)
        except SystemExit:
            raise
        except Exception as exc:
            quiet(exc)

    def end(self, *, loss: Any = None, tokens: int | None = None) -> None:
        """Close the step: a rollback or a stop from the collector runs here (the step
        boundary); a stop raises ``SystemExit``."""
        s, self._step = self._step, None
        if s is None:
            return
        if tokens is not None:
            s._record.tokens = tokens  # known only once the step's forwards ran
        if loss is not None:
            s.loss(loss)
        s.__exit__(None, None, None)


def owner_of(obj: Any, kind: Any, attribute: str) -> Any:
    """The object of class ``kind`` whose ``attribute`` is ``obj``, or None (looked up
    once, from the objects that refer to ``obj``: a framework hands its callbacks the
    model, not what holds it)."""
    for holder in gc.get_referrers(obj):
        if not isinstance(holder, dict) or holder.get(attribute) is not obj:
            continue
        for owner in gc.get_referrers(holder):
            if isinstance(owner, kind) and getattr(owner, "__dict__", None) is holder:
                return owner
    return None


def ddp_of(module: Any) -> Any:
    """The ``DistributedDataParallel`` wrapping ``module``, or None: the module sits in
    the wrapper's ``_modules`` (a dict in the wrapper's ``__dict__``)."""
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel
    if isinstance(module, ddp):
        return module
    for modules in gc.get_referrers(module):
        if not isinstance(modules, dict) or modules.get("module") is not module:
            continue
        for attributes in gc.get_referrers(modules):
            if not isinstance(attributes, dict) or attributes.get("_modules") is not modules:
                continue
            for owner in gc.get_referrers(attributes):
                if isinstance(owner, ddp) and getattr(owner, "__dict__", None) is attributes:
                    return owner
    return None


def init_process_group(backend: str) -> None:
    """``torch.distributed.init_process_group(backend)`` from the launcher's environment.
    Under torchrun the launcher's store outlives a restart: the restarted ranks meet
    under a prefix of their own (the restart count), or they would read the previous
    attempt's addresses and time out on them (seen with ``--standalone`` and gloo)."""
    from datetime import timedelta

    import torch.distributed as dist

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if not os.environ.get("TORCHELASTIC_RUN_ID") or restart is None:
        dist.init_process_group(backend)
        return
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"attempt-{restart}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )
