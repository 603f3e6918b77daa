"""Hugging Face Transformers: ``Trainer(..., callbacks=[TrainwardenCallback()])``.

Install with ``pip install 'trainwarden[hf]'`` (transformers, in the range tested:
:data:`.common.TESTED`).

What the callback does, in the Trainer's own callbacks:

- ``on_train_begin``: starts the agent unless the script did (``tw.init``): the run name
  from ``run=``, else ``TRAINWARDEN_RUN``, else ``args.run_name`` (when the user set one),
  else the output directory's name; the config is ``args.to_dict()``; rank, world and
  local rank come from ``args`` (any launcher). Then ``tw.watch`` on the model (phases;
  with DDP the comm split from its communication hook; the gradient norm from the
  optimizer's pre-hook) and a forward hook that keeps each training forward's ``loss``
  and counts its tokens; the gradient norm is the one the Trainer computes before
  clipping (``max_grad_norm``).
- ``on_step_begin`` / ``on_step_end``: one optimizer step is one trainwarden step
  (gradient accumulation: its micro-batches are one step), numbered ``state.global_step``
  before the update (0 first). The loss is the mean of the step's micro-batch losses on
  this rank, on every step, computed on the device: no host sync (the Trainer's own
  logged loss is an average over ``logging_steps`` and across ranks).
- ``on_optimizer_step``: the learning rate the update used (the first parameter group's,
  a Python float: no host sync), read before the scheduler steps, as the Trainer logs
  its ``learning_rate``: the built-in metric ``lr`` (``s.lr``).
- ``on_save``: ``tw.checkpoint_saved`` for ``checkpoint-N`` (the weights after update
  ``N - 1``).
- A **rollback** runs in-process at the step boundary: the checkpoint's weights,
  optimizer and scheduler are loaded on every rank, ``state.global_step`` goes back to the
  step after the checkpoint's, and the learning rate is scaled as the plan says. The
  Trainer's data loader goes on forward: the batches between the checkpoint and the
  anomaly are skipped, not replayed (what a loss-spike rollback asks; a rollback that
  asks to keep the data, for silent data corruption, gets later batches too: the callback
  says so in the log). A **stop** ends the process with ``tw.STOPPED_EXIT_CODE`` at the
  step boundary, after flushing.

Nothing here fails the training: no collector URL, no run name, a transformers outside
the tested range, or an error of the callback: one line in the log, training goes on
unobserved.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import transformers
from transformers import TrainerCallback

from .. import checkpoint_saved, on_rollback, watch
from .. import core as _core
from ..commands import RollbackPlan
from ..values import capture
from . import common

log = logging.getLogger("trainwarden")


class TrainwardenCallback(TrainerCallback):
    """A ``TrainerCallback`` that observes each optimizer step with trainwarden.

    ``run`` / ``url``: the run's name and the collector (else ``TRAINWARDEN_RUN`` /
    ``TRAINWARDEN_URL`` and the Trainer's facts); ``init``: more ``tw.init`` arguments
    (``flush_interval_s=...``, ``dataset_size=...``); ``watch``: more ``tw.watch``
    arguments (``replica_check_every=...``)."""

    def __init__(
        self,
        run: str | None = None,
        url: str | None = None,
        *,
        init: dict[str, Any] | None = None,
        watch: dict[str, Any] | None = None,
    ) -> None:
        self._run, self._url = run, url
        self._init = dict(init or {})
        self._watch = dict(watch or {})
        self._on = False
        self._span = common.Span()
        self._tap: common.LossTap | None = None
        self._trainer_refs: dict[str, Any] = {}
        self._args: Any = None
        self._state: Any = None
        common.ask_flight_recorder(self._init)  # before the process group is made

    # -- start --------------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self._run or _run_name(args)
        self._on = common.start(
            framework="transformers Trainer",
            package="transformers",
            version=transformers.__version__,
            run=run,
            url=self._url,
            config=_config(args),
            init=self._init,
            place=(args.process_index, args.world_size, args.local_process_index),
        )
        if not self._on:
            return
        try:
            self._attach(args, state, kwargs)
        except Exception as exc:  # the trainer goes on; the integration goes quiet
            log.warning("trainwarden: the Trainer callback could not attach (%s): unobserved", exc)
            self._on = False

    def _attach(self, args: Any, state: Any, kwargs: dict[str, Any]) -> None:
        model = kwargs.get("model")
        optimizer = kwargs.get("optimizer")
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
        wrapped = common.ddp_of(model) if model is not None else None
        if model is not None:
            watch(wrapped or model, inner, grad_norm=inner is not None, **self._watch)
            self._tap = common.LossTap(model)
            _report_unclipped_norm(common.owner_of(model, transformers.Trainer, "model"))
        self._trainer_refs = {
            "model": model,
            "optimizer": inner,
            "lr_scheduler": kwargs.get("lr_scheduler"),
        }
        self._args, self._state = args, state
        on_rollback(self._rollback)

    # -- each optimizer step ------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._on:
            self._guard(self._span.begin, state.global_step)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._on and self._span.open:
            self._guard(self._record_lr)

    def _record_lr(self) -> None:
        optimizer = self._trainer_refs.get("optimizer")
        lr = optimizer.param_groups[0].get("lr") if optimizer is not None else None
        if isinstance(lr, (int, float)):
            self._span.step.lr(float(lr))
        elif lr is not None and hasattr(lr, "detach"):
            self._span.step.lr(lr.detach().clone())  # a tensor: read later

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._on or not self._span.open:
            return
        loss, tokens = self._tap.take() if self._tap is not None else (None, None)
        # A stop raises SystemExit here, on purpose: the process ends at the boundary.
        self._guard(lambda: self._span.end(loss=loss, tokens=tokens))

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._on or state.global_step < 1:
            return
        if not state.is_world_process_zero:
            return  # rank 0 wrote it; one report of it
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self._guard(checkpoint_saved, state.global_step - 1, path)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._on and self._span.open:
            self._guard(self._span.end)
        if self._tap is not None:
            self._tap.remove()
            self._tap = None
        agent = _core._agent
        if agent is not None:  # a later train() of this process attaches again
            agent.commands.off_rollback(self._rollback)

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except SystemExit:
            raise  # a stop command
        except Exception as exc:
            log.warning("trainwarden: the Trainer callback failed (%s): unobserved from here", exc)
            self._on = False

    # -- a rollback, in-process ---------------------------------------------------------

    def _rollback(self, plan: RollbackPlan) -> None:
        import torch

        folder = plan.checkpoint_path
        refs = self._trainer_refs
        model, optimizer, scheduler = refs["model"], refs["optimizer"], refs["lr_scheduler"]
        weights = os.path.join(folder, "model.safetensors")
        if os.path.exists(weights):
            from safetensors.torch import load_file

            state = load_file(weights)
        else:
            state = torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=True)
        missing, _unexpected = model.load_state_dict(state, strict=False)
        tied = set(getattr(model, "_tied_weights_keys", None) or ())
        if set(missing) - tied - _tied_names(model):
            raise RuntimeError(f"checkpoint {folder} lacks weights: {sorted(missing)[:5]}")
        if optimizer is not None and os.path.exists(os.path.join(folder, "optimizer.pt")):
            optimizer.load_state_dict(
                torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True)
            )
        if scheduler is not None and os.path.exists(os.path.join(folder, "scheduler.pt")):
            scheduler.load_state_dict(
                torch.load(os.path.join(folder, "scheduler.pt"), weights_only=True)
            )
        if plan.lr_scale:
            if scheduler is not None and hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * plan.lr_scale for lr in scheduler.base_lrs]
            if optimizer is not None:
                for group in optimizer.param_groups:
                    group["lr"] *= plan.lr_scale
        self._state.global_step = plan.checkpoint_step + 1
        if plan.skip_to < plan.skip_from:
            log.warning(
                "trainwarden: rollback %d asks to replay the same data; the Trainer's loader "
                "goes on forward: later batches are trained on instead",
                plan.action,
            )
        log.warning(
            "trainwarden: rolled back to %s (step %d) after step %d",
            folder,
            plan.checkpoint_step,
            plan.barrier_step,
        )


def _report_unclipped_norm(trainer: Any) -> None:
    """The gradient norm the Trainer computes before clipping (``max_grad_norm``) is the
    step's, as the Trainer logs it: the optimizer's pre-hook would see the clipped one."""
    get = getattr(trainer, "_get_grad_norm", None)
    if get is None:
        log.info("trainwarden: the Trainer's gradient norm is not reachable: the clipped one")
        return

    def _get_grad_norm(*args: Any, **kwargs: Any) -> Any:
        norm = get(*args, **kwargs)
        agent = _core._agent
        record = agent.recorder.current if agent is not None else None
        if record is not None and norm is not None:
            record.grad_norm = capture(norm)  # a tensor: read later, off this thread
        return norm

    trainer._get_grad_norm = _get_grad_norm


def _tied_names(model: Any) -> set[str]:
    """Parameters that share their storage with another (tied embeddings): a checkpoint
    keeps one of them."""
    seen: dict[int, str] = {}
    tied = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            tied.add(name)
            tied.add(seen[key])
        seen[key] = name
    return tied


def _run_name(args: Any) -> str | None:
    """``args.run_name`` when set apart from the output directory, else the output
    directory's name."""
    name = getattr(args, "run_name", None)
    out = getattr(args, "output_dir", None)
    if name and name != out:
        return str(name)
    if out:
        return os.path.basename(os.path.normpath(str(out))) or None
    return None


def _config(args: Any) -> dict[str, Any] | None:
    try:
        facts = args.to_dict()
    except Exception:
        return None
    facts["framework"] = f"transformers {transformers.__version__}"
    return facts
