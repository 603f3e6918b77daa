"""torchtitan: ``trainer = tw_torchtitan.build_trainer(config)`` in place of
``config.build()`` (torchtitan's ``train.py`` otherwise unchanged).

torchtitan's ``Trainer`` owns its loop (``train()`` calls ``train_step`` once a step,
then ``checkpointer.save``); its metric loggers see the logged aggregates only (the loss
averaged across ranks every ``log_freq`` steps). So the integration is a subclass of the
Trainer, made by :func:`observed_class` over any Trainer class (torchtitan's own, or an
experiment's subclass of it), that:

- starts the agent after torchtitan's ``__init__`` (the process group and the model
  exist): rank and world size from the process group, local rank from ``LOCAL_RANK``;
  the run from ``run=`` / ``TRAINWARDEN_RUN``, else the name of ``dump_folder``; the config
  is torchtitan's (``config.to_dict()``); ``flops_per_token`` is torchtitan's own count
  (``metrics_processor.num_flops_per_token``), so trainwarden's MFU and torchtitan's count
  the same FLOPs;
- wraps each ``train_step`` in one trainwarden step numbered as torchtitan numbers it
  (``trainer.step``, 1 first): this rank's loss (the sum of its micro-batches'
  ``forward_backward_step`` losses, each its local loss sum over the global valid
  tokens, times the global valid tokens over this rank's: all on the device, no host
  sync; with pipeline parallelism only the last stage has one), the gradient norm
  ``clip_grad_norm_`` returned (the global one torchtitan computes, kept as a tensor),
  the tokens (the labels' elements, as ``ntokens_seen`` counts them), phases from
  ``tw.watch`` on the first model part and the optimizers container;
- reports each checkpoint ``checkpointer.save`` wrote (it returns True), by rank 0, as
  ``<checkpoint folder>/step-N`` holding the weights after step N;
- rolls back in process at the step boundary: ``checkpointer.load(step=N)`` on every rank
  (model, optimizers, schedulers, dataloader, train state: ``trainer.step`` becomes N),
  then the plan's learning-rate scale; the save that ``train()`` makes right after the
  step is skipped (it would write step N's checkpoint again). The dataloader's state is
  the checkpoint's: the batches after it are drawn again, not skipped.

A stop raises ``SystemExit(tw.STOPPED_EXIT_CODE)`` out of ``train_step``. Nothing here
fails the training: any error of the integration is said once and it goes quiet.

It cannot run on a CPU (torchtitan needs CUDA and triton): ``scripts/gpu_check.sh`` runs it
on the llama3 debug model; tests/agent/test_integration_torchtitan.py checks the logic
on CPU over a stand-in Trainer.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .. import checkpoint_saved, on_rollback, watch
from ..commands import RollbackPlan
from . import common

log = logging.getLogger("trainwarden")

IGNORE_INDEX = -100
"""torchtitan's label for a position that counts in no loss."""


def build_trainer(config: Any, run: str | None = None, url: str | None = None, **init: Any) -> Any:
    """torchtitan's Trainer for ``config`` (the one ``config.build()`` would make),
    observed; ``init``: more ``tw.init`` arguments."""
    from torchtitan.distributed import utils as dist_utils

    owner = getattr(config, "_owner", None)
    if owner is None:
        from torchtitan.trainer import Trainer

        owner = Trainer
    return observed_class(owner, dist_utils)(config, tw_run=run, tw_url=url, tw_init=init)


def observed_class(base: type, norm_module: Any) -> type:
    """A subclass of the Trainer class ``base`` observed by trainwarden;
    ``norm_module``: the module whose ``clip_grad_norm_`` the Trainer's ``train_step``
    calls (``torchtitan.distributed.utils``)."""

    class Observed(base):  # type: ignore[valid-type,misc]
        def __init__(
            self,
            config: Any,
            *,
            tw_run: str | None = None,
            tw_url: str | None = None,
            tw_init: dict[str, Any] | None = None,
        ) -> None:
            super().__init__(config)
            self._tw = Observer(self, norm_module, tw_run, tw_url, dict(tw_init or {}))

        def train_step(self, data_iterator: Any) -> Any:
            return self._tw.train_step(super().train_step, data_iterator)

        def forward_backward_step(self, **kwargs: Any) -> Any:
            loss = super().forward_backward_step(**kwargs)
            self._tw.micro_batch(loss, kwargs.get("labels"), kwargs.get("global_valid_tokens"))
            return loss

    Observed.__name__ = Observed.__qualname__ = f"Observed{base.__name__}"
    return Observed


class Observer:
    """What the observed Trainer does besides torchtitan's own work."""

    def __init__(
        self,
        trainer: Any,
        norm_module: Any,
        run: str | None,
        url: str | None,
        init: dict[str, Any],
    ) -> None:
        self.trainer, self.norm_module = trainer, norm_module
        self.span = common.Span()
        self.on = False
        self._losses: list[Any] = []
        self._tokens = 0
        self._local_valid: list[Any] = []
        self._global_valid: Any = None
        self._norm: Any = None
        self._skip_save = False
        self._watched: Any = None
        try:
            self.on = self._start(run, url, init)
        except Exception as exc:
            self._quiet(exc)

    def _start(self, run: str | None, url: str | None, init: dict[str, Any]) -> bool:
        import torch.distributed as dist

        trainer = self.trainer
        config = trainer.config
        flops = getattr(getattr(trainer, "metrics_processor", None), "num_flops_per_token", -1)
        if flops and flops > 0:
            init.setdefault("flops_per_token", float(flops))
        place = None
        if dist.is_available() and dist.is_initialized():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            place = (dist.get_rank(), dist.get_world_size(), local)
        facts = config.to_dict() if hasattr(config, "to_dict") else {}
        facts = {**facts, "framework": f"torchtitan {_version()}"}
        folder = getattr(config, "dump_folder", None)
        name = os.path.basename(os.path.normpath(str(folder))) if folder else None
        if not common.start(
            framework="torchtitan",
            package="torchtitan",
            version=_version(),
            run=run or name or None,
            url=url,
            config=facts,
            init=init,
            place=place,
        ):
            return False
        parts = getattr(trainer, "model_parts", None) or []
        if parts:
            self._watched = watch(parts[0], getattr(trainer, "optimizers", None), comm=False)
        checkpointer = trainer.checkpointer
        save = checkpointer.save

        def save_(curr_step: int, *args: Any, **kwargs: Any) -> Any:
            if self._skip_save:  # the step a rollback restored: its checkpoint exists
                self._skip_save = False
                return False
            began = time.perf_counter()
            saved = save(curr_step, *args, **kwargs)
            if saved and self.on:
                self._saved(curr_step, time.perf_counter() - began)
            return saved

        checkpointer.save = save_
        on_rollback(self._rollback)
        return True

    def _quiet(self, exc: Exception) -> None:
        log.warning(
            "trainwarden: the torchtitan integration failed (%s): unobserved from here", exc
        )
        self.on = False

    # -- each step ----------------------------------------------------------------------

    def train_step(self, step_fn: Any, data_iterator: Any) -> Any:
        if not self.on:
            return step_fn(data_iterator)
        try:
            self._losses, self._tokens, self._local_valid, self._norm = [], 0, [], None
            self.span.begin(self.trainer.step)
        except Exception as exc:
            self._quiet(exc)
            return step_fn(data_iterator)
        module = self.norm_module
        clip = module.clip_grad_norm_

        def clip_(*args: Any, **kwargs: Any) -> Any:
            norm = clip(*args, **kwargs)
            self._norm = norm  # the global norm, before clipping, on the device
            return norm

        module.clip_grad_norm_ = clip_
        try:
            out = step_fn(data_iterator)
        finally:
            module.clip_grad_norm_ = clip
        try:
            loss = self._rank_loss()
            step = self.span.step
            if step is not None and self._norm is not None:
                step.grad_norm(self._norm)
            tokens = self._tokens or None
        except Exception as exc:
            self._quiet(exc)
            return out
        # A rollback runs here (the step boundary); a stop raises SystemExit, on purpose.
        self.span.end_or_quiet(self._quiet, loss=loss, tokens=tokens)
        return out

    def micro_batch(self, loss: Any, labels: Any, global_valid: Any) -> None:
        """One ``forward_backward_step``'s loss (this rank's loss sum over the global
        valid tokens), its labels and the global valid tokens; no host sync."""
        if not self.on or not self.span.open:
            return
        try:
            trainer = self.trainer
            dims = getattr(trainer, "parallel_dims", None)
            labels = labels if isinstance(labels, list) else [labels]
            self._tokens += sum(int(t.numel()) for t in labels)
            if getattr(dims, "pp_enabled", False) and not getattr(
                trainer, "pp_has_last_stage", True
            ):
                return  # no loss on this pipeline stage
            self._losses.append(loss.detach().reshape(()))
            self._local_valid.extend((t != IGNORE_INDEX).sum() for t in labels)
            self._global_valid = global_valid
        except Exception as exc:
            self._quiet(exc)

    def _rank_loss(self) -> Any:
        """This rank's mean loss over its valid tokens, on the device."""
        if not self._losses or self._global_valid is None:
            return None
        import torch

        total = torch.stack([x.float() for x in self._losses]).sum()
        local = torch.stack([n.to(total.device) for n in self._local_valid]).sum()
        return total * self._global_valid.to(total.device) / local.clamp(min=1)

    # -- checkpoints and rollbacks -------------------------------------------------------

    def _saved(self, step: int, seconds: float) -> None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() != 0:
            return
        checkpointer = self.trainer.checkpointer
        path = checkpointer._create_checkpoint_id(step)
        try:
            checkpoint_saved(step, str(path), seconds=seconds)
        except Exception as exc:  # the agent is gone: the save stands
            log.warning("trainwarden: torchtitan: checkpoint %s not reported (%s)", path, exc)

    def _rollback(self, plan: RollbackPlan) -> None:
        trainer = self.trainer
        if not trainer.checkpointer.load(step=plan.checkpoint_step):
            raise RuntimeError(f"torchtitan loaded no checkpoint of step {plan.checkpoint_step}")
        if trainer.step != plan.checkpoint_step:
            raise RuntimeError(
                f"the checkpoint of step {plan.checkpoint_step} holds step {trainer.step}"
            )
        if plan.lr_scale:
            for scheduler in getattr(trainer.lr_schedulers, "schedulers", []):
                base = getattr(scheduler, "base_lrs", None)
                if base is not None:
                    scheduler.base_lrs = [lr * plan.lr_scale for lr in base]
            for group in trainer.optimizers.param_groups:
                group["lr"] *= plan.lr_scale
        self._skip_save = True
        if plan.skip_to >= plan.skip_from:
            log.warning(
                "trainwarden: rollback %d asks to skip the batches that led to it; torchtitan's "
                "dataloader was restored with the checkpoint: they are trained on again",
                plan.action,
            )
        common.said_rolled_back(plan, plan.checkpoint_path, None)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchtitan")
    except PackageNotFoundError:
        return "0"
