"""DeepSpeed: ``engine, *_ = deepspeed.initialize(...)`` then ``tw_deepspeed.watch(engine)``.

Install with ``pip install 'trainwarden[deepspeed]'`` (deepspeed in the range tested:
:data:`.common.TESTED`).

What :func:`watch` does to the engine it is given (the loop stays the user's own:
``loss = engine(batch); engine.backward(loss); engine.step()``):

- Starts the agent unless the script did (``tw.init``): the run name from ``run=``, else
  ``TRAINWARDEN_RUN``, else the ``job_name`` of a DeepSpeed monitor the config enables
  (TensorBoard, CSV, W&B: not its default ``DeepSpeedJobName``); the config is the
  DeepSpeed config the engine was given, with ``framework``; rank, world and local rank
  are the engine's (``global_rank``, ``world_size``, ``local_rank``), under any launcher.
- Each **optimizer step** is one trainwarden step, numbered ``engine.global_steps``
  before the update (0 first): opened at its first micro-batch's forward (a forward
  pre-hook on the engine) and closed after ``engine.step()`` at the gradient
  accumulation boundary (``engine.is_gradient_accumulation_boundary()``, asked before
  the step, as DeepSpeed itself does).
- **Loss, per rank**: the loss each ``engine.backward(loss)`` is given, detached and kept
  on its device; the step's is the mean over its micro-batches, computed on the device
  (no host sync). **Tokens**: each micro-batch's ``input_ids`` (a keyword argument, a
  mapping's, the batch tensor itself), by shape.
- **Gradient norm**: the one DeepSpeed computed in the step
  (``engine.get_global_grad_norm()``: under ZeRO-1/2 a tensor on the device, the norm
  over every rank's partition, before clipping): kept as it is and read off the
  training thread. **Learning rate**: the first parameter group's
  (``engine.get_lr()``), read before ``engine.step()`` steps the scheduler: the built-in
  metric ``lr``.
- **Phases**: ``tw.watch`` on ``engine.module`` and the torch optimizer inside ZeRO's
  (forward, backward from the module's hooks; drills); ``optimizer`` is marked again at
  ``engine.step()``'s start, so the ZeRO work before the torch update (the norm's
  all-reduce) is the optimizer's; after the torch update, ``other`` holds ZeRO's
  parameter all-gather. The comm split comes from the sampled profiler window
  (``profile_every``): DeepSpeed has no communication hook to time each bucket by.
- **Checkpoints**: ``engine.save_checkpoint(save_dir, tag)`` is reported, by global rank
  0, as ``save_dir/tag`` holding the weights after update ``global_steps - 1``.
- A **rollback** runs at the step boundary on every rank: ``engine.load_checkpoint``
  (weights, ZeRO's optimizer partitions, the scheduler; it sets ``engine.global_steps``
  to the checkpoint's), then the plan's learning-rate scale. The user's loop goes on
  with its next batch (the batches between the checkpoint and the anomaly are skipped).
  A **stop** raises ``SystemExit(tw.STOPPED_EXIT_CODE)`` out of ``engine.step()``.

Nothing here fails the training: no collector URL, no run name, a deepspeed outside the
tested range, or an error of the integration: one line in the log, training goes on
unobserved.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import deepspeed

from .. import checkpointing, on_rollback
from .. import core as _core
from .. import watch as tw_watch
from ..commands import RollbackPlan
from . import common

log = logging.getLogger("trainwarden")

DEFAULT_JOB_NAME = "DeepSpeedJobName"
"""The monitors' job name when the config names none: not a run's name."""


def watch(
    engine: Any,
    run: str | None = None,
    url: str | None = None,
    *,
    init: dict[str, Any] | None = None,
    watch: dict[str, Any] | None = None,
    tokens: Callable[[Any], int | None] | None = None,
) -> DeepSpeedWatch:
    """Observe ``engine`` (a ``DeepSpeedEngine`` from ``deepspeed.initialize``).

    ``run`` / ``url``: the run's name and the collector (else ``TRAINWARDEN_RUN`` /
    ``TRAINWARDEN_URL``); ``init``: more ``tw.init`` arguments; ``watch``: more
    ``tw.watch`` arguments; ``tokens``: a function of a forward's first argument (or
    its keyword arguments) giving its tokens. ``.on`` says whether it observes;
    ``.remove()`` gives the engine its own methods back."""
    return DeepSpeedWatch(engine, run, url, init=init, watch=watch, tokens=tokens)


class DeepSpeedWatch:
    """What :func:`watch` put on one engine."""

    def __init__(
        self,
        engine: Any,
        run: str | None,
        url: str | None,
        *,
        init: dict[str, Any] | None,
        watch: dict[str, Any] | None,
        tokens: Callable[[Any], int | None] | None,
    ) -> None:
        self.engine = engine
        self._count_tokens = tokens or common.tokens_of
        self._span = common.Span()
        self._losses: list[Any] = []
        self._tokens = 0
        self._handles: list[Any] = []
        self._watched: Any = None
        self.on = common.start(
            framework="DeepSpeed",
            package="deepspeed",
            version=deepspeed.__version__,
            run=run or run_name(engine),
            url=url,
            config=_config(engine),
            init=dict(init or {}),
            place=(engine.global_rank, engine.world_size, engine.local_rank),
        )
        if not self.on:
            return
        try:
            self._attach(dict(watch or {}))
        except Exception as exc:  # the trainer goes on; the integration goes quiet
            log.warning("trainwarden: DeepSpeed: could not attach (%s): unobserved", exc)
            self.remove()

    def _attach(self, watch_args: dict[str, Any]) -> None:
        engine = self.engine
        watch_args.setdefault("comm", False)  # no DDP wrapper: the profiler window splits
        self._watched = tw_watch(engine.module, torch_optimizer(engine), **watch_args)
        self._handles.append(
            engine.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        )
        backward, step, save = engine.backward, engine.step, engine.save_checkpoint

        # Instance attributes over the engine's methods: DeepSpeed has no hooks for
        # these, and the user's loop calls them by name.
        def backward_(loss: Any, *args: Any, **kwargs: Any) -> Any:
            if self.on:
                self._on_backward(loss)
            return backward(loss, *args, **kwargs)

        def step_(*args: Any, **kwargs: Any) -> Any:
            boundary = self.on and self._before_step()
            out = step(*args, **kwargs)
            if boundary:
                self._after_step()
            return out

        def save_checkpoint(save_dir: Any, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
            timed = self._checkpointing(save_dir, tag) if self.on else None
            if timed is None:
                return save(save_dir, tag, *args, **kwargs)
            with timed:
                return save(save_dir, tag, *args, **kwargs)

        engine.backward, engine.step, engine.save_checkpoint = backward_, step_, save_checkpoint
        on_rollback(self._rollback)

    def remove(self) -> None:
        """The engine's own methods and no hooks again (the open step is closed)."""
        self.on = False
        if self._span.open:
            try:
                self._span.end()
            except Exception as exc:
                log.warning("trainwarden: DeepSpeed: the last step did not close (%s)", exc)
        for name in ("backward", "step", "save_checkpoint"):
            self.engine.__dict__.pop(name, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._watched is not None:
            self._watched.remove()
            self._watched = None
        agent = _core._agent
        if agent is not None:
            agent.commands.off_rollback(self._rollback)

    def _quiet(self, exc: Exception) -> None:
        log.warning("trainwarden: the DeepSpeed integration failed (%s): unobserved from here", exc)
        self.remove()

    # -- each optimizer step ------------------------------------------------------------

    def _open(self) -> None:
        if not self._span.open:  # the step's first micro-batch
            self._losses, self._tokens = [], 0
            self._span.begin(self.engine.global_steps)

    def _before_forward(self, module: Any, args: Any, kwargs: Any) -> None:
        if not self.on or not module.training:
            return
        try:
            self._open()
            tokens = self._count_tokens(args[0] if args else kwargs)
            if tokens:
                self._tokens += int(tokens)
        except Exception as exc:
            self._quiet(exc)

    def _on_backward(self, loss: Any) -> None:
        try:
            self._open()  # a forward that did not go through the engine
            if getattr(loss, "ndim", None) == 0:
                self._losses.append(loss.detach())
        except Exception as exc:
            self._quiet(exc)

    def _before_step(self) -> bool:
        try:
            if not self.engine.is_gradient_accumulation_boundary() or not self._span.open:
                return False
            common.mark("optimizer")
            rates = self.engine.get_lr()  # what this update uses: the scheduler steps after it
            if rates and isinstance(rates[0], (int, float)) and self._span.step is not None:
                self._span.step.lr(float(rates[0]))
            return True
        except Exception as exc:
            self._quiet(exc)
            return False

    def _after_step(self) -> None:
        try:
            step = self._span.step
            norm = self.engine.get_global_grad_norm()
            if norm is not None and step is not None:
                step.grad_norm(norm)  # a tensor under ZeRO-1/2: read off this thread
            loss = common.mean_loss(self._losses)
            tokens = self._tokens or None
            self._losses, self._tokens = [], 0
        except Exception as exc:
            self._quiet(exc)
            return
        # A rollback runs here (the step boundary); a stop raises SystemExit, on purpose.
        self._span.end_or_quiet(self._quiet, loss=loss, tokens=tokens)

    # -- checkpoints --------------------------------------------------------------------

    def _checkpointing(self, save_dir: Any, tag: Any) -> Any:
        """Rank 0's report of the save (``save_dir/tag``, the weights after update
        ``global_steps - 1``), timed around it; None on the other ranks, before the first
        update, or when the agent is gone. DeepSpeed's default tag is
        ``global_step{global_steps}``."""
        engine = self.engine
        step = engine.global_steps - 1
        if engine.global_rank != 0 or step < 0:
            return None
        tag = f"global_step{engine.global_steps}" if tag is None else tag
        try:
            return checkpointing(step, os.path.join(str(save_dir), str(tag)))
        except Exception:  # the agent is gone: the save goes on
            return None

    # -- a rollback, in-process ---------------------------------------------------------

    def _rollback(self, plan: RollbackPlan) -> None:
        engine = self.engine
        path = os.path.normpath(plan.checkpoint_path)
        # Every rank: the ZeRO stages load each rank's optimizer partition (collectively).
        loaded, _ = engine.load_checkpoint(os.path.dirname(path), tag=os.path.basename(path))
        if loaded is None:
            raise RuntimeError(f"DeepSpeed loaded no checkpoint from {path}")
        if engine.global_steps != plan.checkpoint_step + 1:
            raise RuntimeError(
                f"{path} holds global step {engine.global_steps}, not "
                f"{plan.checkpoint_step + 1}: overwritten since it was reported?"
            )
        if plan.lr_scale:
            scheduler = engine.lr_scheduler
            base = getattr(scheduler, "base_lrs", None)
            if base is not None:
                scheduler.base_lrs = [lr * plan.lr_scale for lr in base]
            optimizer = torch_optimizer(engine)
            for group in optimizer.param_groups if optimizer is not None else ():
                group["lr"] *= plan.lr_scale
        common.said_rolled_back(plan, path, "the loop's loader")


# -- the pieces --------------------------------------------------------------------------


def torch_optimizer(engine: Any) -> Any:
    """The torch optimizer that makes the update: inside ZeRO's (``.optimizer``), or the
    engine's own; None when there is none (a ``DummyOptim``)."""
    import torch

    optimizer = engine.optimizer
    for candidate in (getattr(optimizer, "optimizer", None), optimizer):
        if isinstance(candidate, torch.optim.Optimizer):
            return candidate
    return None


def run_name(engine: Any) -> str | None:
    """The ``job_name`` of a monitor the DeepSpeed config enables, unless the default."""
    monitor = getattr(getattr(engine, "_config", None), "monitor_config", None)
    for name in ("tensorboard", "csv_monitor", "wandb", "comet"):
        part = getattr(monitor, name, None)
        job = getattr(part, "job_name", None) or getattr(part, "experiment_name", None)
        if getattr(part, "enabled", False) and job and job != DEFAULT_JOB_NAME:
            return str(job)
    return None


def _config(engine: Any) -> dict[str, Any] | None:
    try:
        facts: dict[str, Any] = dict(getattr(engine._config, "_param_dict", None) or {})
        facts.update(
            zero_stage=engine.zero_optimization_stage(),
            gradient_accumulation_steps=engine.gradient_accumulation_steps(),
            train_batch_size=engine.train_batch_size(),
            world_size=engine.world_size,
        )
    except Exception:
        return None
    facts["framework"] = f"deepspeed {deepspeed.__version__}"
    return facts
