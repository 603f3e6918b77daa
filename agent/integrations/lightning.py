"""PyTorch Lightning: ``Trainer(..., callbacks=[TrainwardenCallback()])``.

Install with ``pip install 'trainwarden[lightning]'`` (the ``lightning`` package, in the
range tested: :data:`.common.TESTED`).

What the callback does, in the Trainer's own hooks:

- ``setup`` (fitting): starts the agent unless the script did (``tw.init``): the run name
  from ``run=``, else ``TRAINWARDEN_RUN``, else the name of a ``CSVLogger`` /
  ``TensorBoardLogger`` you named, else the name of ``default_root_dir`` when you set
  one; the config is the LightningModule's ``hparams`` with the Trainer's facts
  (``max_steps``, ``accumulate_grad_batches``, the strategy, the precision, ...) and
  ``framework``; rank, world and local rank come from the Trainer (any launcher, its own
  included).
- ``on_fit_start`` (the strategy has wrapped the model and made the optimizers):
  ``tw.watch`` on ``trainer.strategy.model`` (the ``DistributedDataParallel`` wrapper
  under the DDP strategy: its communication hook gives the comm split) and the first
  torch optimizer (``trainer.optimizers[0]``: drills, the replica check). Checkpoints
  are reported from ``trainer.save_checkpoint``, through which ``ModelCheckpoint`` saves.
- ``on_train_batch_start`` / ``on_train_batch_end``: one optimizer step is one
  trainwarden step (``accumulate_grad_batches``: its micro-batches are one step), opened
  at its first micro-batch and closed after the optimizer step, numbered
  ``trainer.global_step`` before the update (0 first). The loss is this rank's: the
  ``training_step``'s loss (``outputs["loss"]``, detached), averaged over the step's
  micro-batches on the device: every step, no host sync (``trainer.callback_metrics``
  holds the logged, possibly synced, values). Tokens: each micro-batch's ``input_ids``
  (or the batch tensor, or the integer tensor first in a tuple), by shape.
- ``on_before_backward`` / ``on_before_optimizer_step``: the backward and optimizer
  phases; the gradient norm (before clipping) is computed on the device in
  ``on_before_optimizer_step``, with the learning rate of the first parameter group
  (the built-in metric ``lr``). The torch optimizer's own pre-hook, which ``tw.watch``
  uses in a hand-written loop, runs in Lightning *before* the closure that does the
  forward and backward (``optimizer.step(closure)``): its gradients would be the
  previous step's.
- A **rollback** runs in-process at the step boundary: every rank loads the
  checkpoint through the strategy (weights, optimizer states; FSDP's too), the
  learning-rate schedulers and the precision plugin's state, scales the learning rate as
  the plan says, and sets the loop's global step to the checkpoint's. The data loader
  goes on forward: the batches between the checkpoint and the anomaly are skipped, not
  replayed. A **stop** raises ``SystemExit(tw.STOPPED_EXIT_CODE)`` at the step boundary,
  after flushing; Lightning runs its ``on_exception`` hooks and the strategy's teardown
  and raises it on: ``trainer.fit`` ends with it and the process exits with that status.

Nothing here fails the training: no collector URL, no run name, a lightning outside the
tested range, or an error of the callback: one line in the log, training goes on
unobserved.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning
from lightning.pytorch import Callback

from .. import checkpointing, on_rollback, watch
from .. import core as _core
from ..commands import RollbackPlan
from ..replica import local_tensor
from ..values import capture
from . import common
from .common import tokens_of

log = logging.getLogger("trainwarden")

DEFAULT_LOGGER_NAME = "lightning_logs"
"""The name Lightning gives its loggers when the user names none: not a run's name."""


class TrainwardenCallback(Callback):
    """A Lightning ``Callback`` that observes each optimizer step with trainwarden.

    ``run`` / ``url``: the run's name and the collector (else ``TRAINWARDEN_RUN`` /
    ``TRAINWARDEN_URL`` and the Trainer's facts); ``init``: more ``tw.init`` arguments
    (``flush_interval_s=...``, ``dataset_size=...``); ``watch``: more ``tw.watch``
    arguments (``replica_check_every=...``); ``tokens``: a function of a batch giving
    its tokens on this rank (an int), when the default (``input_ids``' shape) is wrong."""

    def __init__(
        self,
        run: str | None = None,
        url: str | None = None,
        *,
        init: dict[str, Any] | None = None,
        watch: dict[str, Any] | None = None,
        tokens: Callable[[Any], int | None] | None = None,
    ) -> None:
        self._run, self._url = run, url
        self._init = dict(init or {})
        self._watch_args = dict(watch or {})
        self._count_tokens = tokens or tokens_of
        self._on = False
        self._span = common.Span()
        self._trainer: Any = None
        self._watched: Any = None
        self._save_wrapper: Any = None
        self._losses: list[Any] = []
        self._tokens = 0
        self._loss_scale = 1  # automatic optimization divides the loss by the accumulation
        common.ask_flight_recorder(self._init)  # before Lightning makes its process group

    # -- start --------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage != "fit":
            return
        self._on = common.start(
            framework="Lightning Trainer",
            package="lightning",
            version=lightning.__version__,
            run=self._run or run_name(trainer),
            url=self._url,
            config=_config(trainer, pl_module),
            init=self._init,
            place=(trainer.global_rank, trainer.world_size, trainer.local_rank),
        )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._on:
            return
        try:
            self._attach(trainer, pl_module)
        except Exception as exc:  # the trainer goes on; the integration goes quiet
            log.warning(
                "trainwarden: the Lightning callback could not attach (%s): unobserved", exc
            )
            self._on = False

    def _attach(self, trainer: Any, pl_module: Any) -> None:
        import torch

        # After strategy.setup: under DDP, trainer.strategy.model is the DDP wrapper.
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = common.ddp_of(pl_module) or model or pl_module
        optimizers = list(trainer.optimizers)
        optimizer = getattr(optimizers[0], "_optimizer", optimizers[0]) if optimizers else None
        self._watched = watch(model, optimizer, **self._watch_args)
        self._trainer = trainer
        self._loss_scale = (
            trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
        )
        self._losses, self._tokens = [], 0
        if self._span.open:  # a step an exception broke, in an earlier fit()
            self._span.end()
        self._wrap_save(trainer)
        on_rollback(self._rollback)

    # -- each optimizer step ------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._on:
            return
        try:
            if not self._span.open:  # the step's first micro-batch
                self._losses, self._tokens = [], 0
                self._span.begin(trainer.global_step)
            tokens = self._count_tokens(batch)
            if tokens:
                self._tokens += int(tokens)
            _mark("forward")
        except Exception as exc:
            self._quiet(exc)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._on:
            _mark("backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if not self._on:
            return
        agent = _core._agent
        record = agent.recorder.current if agent is not None else None
        if record is None:
            return
        _drop_early_optimizer_mark(record)
        record.mark("optimizer")
        if record.grad_norm is None:
            try:
                record.grad_norm = capture(_grad_norm(optimizer))
            except Exception as exc:  # e.g. gradients of a kind the norm cannot stack
                log.warning("trainwarden: no gradient norm from this optimizer (%s)", exc)
        groups = getattr(getattr(optimizer, "_optimizer", optimizer), "param_groups", None)
        lr = groups[0].get("lr") if groups else None
        if isinstance(lr, (int, float)) and self._span.step is not None:
            self._span.step.lr(float(lr))  # the update's: schedulers step after it

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._on or not self._span.open:
            return
        try:
            loss = _loss_of(outputs)
            if loss is not None:
                self._losses.append(loss)
            if _accumulating(trainer, batch_idx):
                return  # more micro-batches before the optimizer step
            loss = _mean(self._losses, self._loss_scale)
            tokens = self._tokens or None
            self._losses, self._tokens = [], 0
        except Exception as exc:
            self._quiet(exc)
            return
        # A rollback runs here (the step boundary); a stop raises SystemExit, on purpose.
        self._span.end_or_quiet(self._quiet, loss=loss, tokens=tokens)

    # -- the end ------------------------------------------------------------------------

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._detach(finished=True)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # A step the exception broke is left open: the agent's exit records the exception.
        self._detach(finished=False)

    def _detach(self, *, finished: bool) -> None:
        if finished and self._on and self._span.open:
            try:
                self._span.end()
            except Exception as exc:
                self._quiet(exc)
        trainer = self._trainer
        if trainer is not None and trainer.__dict__.get("save_checkpoint") is self._save_wrapper:
            del trainer.save_checkpoint  # the Trainer's own method again
        self._save_wrapper = None
        if self._watched is not None:
            self._watched.remove()
            self._watched = None
        agent = _core._agent
        if agent is not None:  # a later fit() of this process attaches again
            agent.commands.off_rollback(self._rollback)

    def _quiet(self, exc: Exception) -> None:
        log.warning("trainwarden: the Lightning callback failed (%s): unobserved from here", exc)
        self._on = False

    # -- checkpoints --------------------------------------------------------------------

    def _wrap_save(self, trainer: Any) -> None:
        """Report each checkpoint ``trainer.save_checkpoint`` writes (``ModelCheckpoint``
        and ``OnExceptionCheckpoint`` save through it), with its path, once written, as
        the weights after update ``global_step - 1``. ``on_save_checkpoint`` is not
        enough: it runs before the write and is not told the path."""
        save = trainer.save_checkpoint

        def save_checkpoint(filepath: Any, *args: Any, **kwargs: Any) -> Any:
            step = trainer.global_step - 1
            if not self._on or step < 0 or not trainer.is_global_zero or _moving(trainer, filepath):
                return save(filepath, *args, **kwargs)
            try:
                timed = checkpointing(step, str(filepath))
            except Exception:  # the agent is gone: the save goes on
                return save(filepath, *args, **kwargs)
            with timed:
                return save(filepath, *args, **kwargs)

        trainer.save_checkpoint = save_checkpoint
        self._save_wrapper = save_checkpoint

    # -- a rollback, in-process ---------------------------------------------------------

    def _rollback(self, plan: RollbackPlan) -> None:
        trainer = self._trainer
        strategy = trainer.strategy
        module = trainer.lightning_module
        path = plan.checkpoint_path
        # The strategy's own load: a file under DDP (every rank reads it), FSDP's full or
        # sharded checkpoint (which it loads into the model and optimizers itself).
        checkpoint = strategy.load_checkpoint(path)
        # Checked before anything is applied (under FSDP the load has filled the model).
        saved = checkpoint.get("global_step")
        if saved is not None and saved != plan.checkpoint_step + 1:
            raise RuntimeError(
                f"{path} holds global step {saved}, not {plan.checkpoint_step + 1}: "
                "overwritten since it was reported?"
            )
        module.on_load_checkpoint(checkpoint)
        strategy.load_model_state_dict(checkpoint, strict=module.strict_loading)
        # FSDP's strategies loaded the optimizers' states in load_checkpoint already.
        if strategy.lightning_restore_optimizer:
            if "optimizer_states" in checkpoint:
                strategy.load_optimizer_state_dict(checkpoint)
            else:
                log.warning(
                    "trainwarden: %s holds weights only (save_weights_only): the optimizer "
                    "keeps its state",
                    path,
                )
        for config, state in zip(
            trainer.lr_scheduler_configs, checkpoint.get("lr_schedulers") or [], strict=False
        ):
            config.scheduler.load_state_dict(state)
        precision = trainer.precision_plugin
        if precision.__class__.__qualname__ in checkpoint:
            precision.load_state_dict(checkpoint[precision.__class__.__qualname__])
        if plan.lr_scale:
            for config in trainer.lr_scheduler_configs:
                base = getattr(config.scheduler, "base_lrs", None)
                if base is not None:
                    config.scheduler.base_lrs = [lr * plan.lr_scale for lr in base]
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] *= plan.lr_scale
        _set_global_step(trainer, plan.checkpoint_step + 1, checkpoint)
        common.said_rolled_back(plan, path, "Lightning's loader")


# -- the pieces --------------------------------------------------------------------------


_mark = common.mark


def _drop_early_optimizer_mark(record: Any) -> None:
    """The torch optimizer's step pre-hook (``tw.watch``'s) ran when Lightning called
    ``optimizer.step(closure)``, before the closure's forward and backward: its
    ``optimizer`` mark is not where the optimizer's work starts."""
    phases = record.phases
    for i in range(len(phases) - 1, -1, -1):
        if phases[i][0] == "optimizer":
            del phases[i]
            gpu = record.gpu
            if gpu is not None and i < len(gpu.marks):
                del gpu.marks[i]
            return


def _grad_norm(optimizer: Any) -> Any:
    """The norm of the optimizer's gradients on this rank, queued on the device (no
    sync). Sharded gradients (FSDP2's DTensors, FSDP's flat shards) give this rank's
    shard's norm: the global one would take a collective."""
    import torch

    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
    grads = [
        local_tensor(p.grad)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    if not grads:
        return None
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))


def _loss_of(outputs: Any) -> Any:
    """The ``training_step``'s loss in ``on_train_batch_end``'s ``outputs``, detached."""
    import torch

    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        return None
    return loss.detach()


def _mean(losses: list[Any], scale: int) -> Any:
    """The micro-batches' mean loss, on the device; automatic optimization hands each
    loss divided by ``accumulate_grad_batches`` (``scale``)."""
    return common.mean_loss(losses, scale)


def _accumulating(trainer: Any, batch_idx: int) -> bool:
    """Whether this micro-batch was not followed by an optimizer step (the loop's own
    answer, as it decided; else counted from ``batch_idx``)."""
    decide = getattr(trainer.fit_loop, "_should_accumulate", None)
    if decide is not None:
        return bool(decide())
    every = trainer.accumulate_grad_batches
    return every > 1 and (batch_idx + 1) % every != 0


def _moving(trainer: Any, filepath: Any) -> bool:
    """A ``ModelCheckpoint``'s ``last`` file, written again at every save: a rollback to
    it would restore a later state than the one it was reported with."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    path = os.path.abspath(str(filepath))
    for callback in trainer.checkpoint_callbacks:
        last = (
            getattr(callback, "last_model_path", None)
            if isinstance(callback, ModelCheckpoint)
            else None
        )
        if last and os.path.abspath(str(last)) == path:
            return True
    return False


def _set_global_step(trainer: Any, step: int, checkpoint: Mapping[str, Any]) -> None:
    """The loop's optimizer-step count (``trainer.global_step``) and the loggers' step,
    as the checkpoint has them."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        done = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        done = loop.manual_optimization.optim_step_progress.total
    done.ready = done.completed = step
    try:
        stepped = checkpoint["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"]
    except (KeyError, TypeError):
        return
    loop._batches_that_stepped = int(stepped)


def run_name(trainer: Any) -> str | None:
    """A run name from the Trainer's facts: the name of a ``CSVLogger`` or
    ``TensorBoardLogger`` that the user named, else ``default_root_dir``'s name when it
    was set (not the working directory); else None.

    Never a logger's version: the local loggers number each launch anew (a restarted
    job would become another run), and the remote ones (W&B, MLflow) know their run id on
    rank 0 only."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    logger = trainer.logger
    if isinstance(logger, (CSVLogger, TensorBoardLogger)):
        name = logger.name
        if name and name != DEFAULT_LOGGER_NAME:
            return str(name)
    root = trainer.default_root_dir
    if root and os.path.abspath(str(root)) != os.getcwd():
        return os.path.basename(os.path.normpath(str(root))) or None
    return None


def _config(trainer: Any, pl_module: Any) -> dict[str, Any] | None:
    try:
        facts: dict[str, Any] = dict(getattr(pl_module, "hparams", None) or {})
        facts.update(
            max_steps=trainer.max_steps,
            max_epochs=trainer.max_epochs,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            gradient_clip_val=trainer.gradient_clip_val,
            strategy=type(trainer.strategy).__name__,
            precision=trainer.precision,
            num_devices=trainer.num_devices,
            num_nodes=trainer.num_nodes,
            world_size=trainer.world_size,
        )
    except Exception:
        return None
    facts["framework"] = f"lightning {lightning.__version__}"
    return facts
