"""Accelerate: ``Accelerator(log_with=[tracker])``, ``tracker.watch(accelerator, model, opt)``.

Install with ``pip install 'trainwarden[accelerate]'`` (accelerate, in the range tested:
:data:`.common.TESTED`).

    tracker = TrainwardenTracker("my-run")                      # trainwarden
    accelerator = Accelerator(log_with=[tracker], gradient_accumulation_steps=2)
    accelerator.init_trackers("my-project", config=hyperparameters)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    tracker.watch(accelerator, model, optimizer)                # trainwarden, on every rank
    for batch in loader:
        with accelerator.accumulate(model):
            loss = loss_fn(model(batch["input_ids"]), batch["labels"])
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

The tracker is one of Accelerate's own (a ``GeneralTracker``, ``name = "trainwarden"``),
with ``main_process_only = False``: trainwarden observes **every rank**. Accelerate calls
a tracker only on the main process (``init_trackers``, ``log`` and ``end_training`` do
nothing elsewhere), so ``watch`` (called on every rank) starts the agent where
``init_trackers`` did not, and has ``accelerator.log`` and ``accelerator.end_training``
reach this tracker on every rank too.

- **Start**: ``init_trackers(project, config=...)`` starts the agent on the main process
  (``tw.init``) with that config plus ``framework`` (``accelerate <version>``) and the
  Accelerator's facts (``accelerate``: processes, distributed type, mixed precision,
  gradient accumulation steps); ``watch`` starts it on the other ranks (rank 0's config
  is the attempt's). The run name: ``TRAINWARDEN_RUN``, else ``run_name``; the collector:
  ``url=``, else ``TRAINWARDEN_URL``. A script that called ``tw.init`` itself keeps its
  agent.
- **Each optimizer step is one step** (gradient accumulation: its micro-batches are
  one): a step opens at the first training forward of the prepared model and is complete
  once the optimizer has stepped (the wrapped optimizer's post-hook; Accelerate skips the
  update while ``accelerator.sync_gradients`` is False). It closes at the first of:
  ``accelerator.log(...)``, ``tracker.step_end()``, the next forward (train or eval),
  ``accelerator.end_training()``: a save after the update is inside the step. Numbered
  from 0, or from the step after the checkpoint ``accelerator.load_state`` restored.
- **Loss, per rank, every step**: the mean of the losses given to ``accelerator.backward``
  in the step (before Accelerate divides them by the accumulation steps), kept on the
  device: no host sync. A loop that calls ``loss.backward()`` itself gets the model
  outputs' ``loss`` instead, when they have one (:class:`.common.LossTap`).
- **Tokens**: the elements of each training forward's ``input_ids`` (or first argument).
- ``tw.watch`` on the prepared model and optimizer: **phases**, with DDP the **comm
  split** from its communication hook, the **gradient norm** on the device; the one
  ``accelerator.clip_grad_norm_`` returns (before clipping) wins when the loop clips.
  The learning rate of the first parameter group is the built-in metric ``lr``.
- ``log(values, step)``: the numbers logged (ints, floats, 0-d tensors, read off the
  training thread) become the step's user metrics (names lower-cased, other characters
  ``_``); a logged ``loss`` is the step's loss only when the step has none of its own.
  Values logged between steps go with the next step.
- **Checkpoints**: ``accelerator.save_state`` (on the main process) is timed and reported
  with ``tw.checkpointing`` as the weights after the last complete step; the folder gets a
  ``trainwarden.json`` with that step, which ``accelerator.load_state`` reads back so the
  step numbers go on from it after a restart.
- A **rollback** runs in-process at the step boundary: every rank calls
  ``accelerator.load_state`` on the checkpoint (model, optimizer, scheduler, scaler, RNG),
  keeps its place in the gradient accumulation, scales the learning rate as the plan
  says, and numbers the next step ``checkpoint_step + 1``. The data loader goes on
  forward: the batches between the checkpoint and the anomaly are skipped. A **stop**
  ends the process with ``tw.STOPPED_EXIT_CODE`` at the step boundary, after flushing.

Nothing here fails the training: no collector URL, no run name, an accelerate outside the
tested range, or an error of the tracker: one line in the log, training goes on
unobserved.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import accelerate
from accelerate.tracking import GeneralTracker

from .. import checkpointing, on_rollback
from .. import core as _core
from .. import watch as tw_watch
from ..commands import RollbackPlan
from ..values import capture
from . import common

log = logging.getLogger("trainwarden")

STEP_FILE = "trainwarden.json"
"""Written by the main process into each ``save_state`` folder: the checkpoint's step."""


_NOT_NAME = re.compile(r"[^a-z0-9_.]")


class TrainwardenTracker(GeneralTracker):
    """An Accelerate tracker that observes every rank's optimizer steps with trainwarden.

    ``run_name`` / ``url``: the run and the collector (``TRAINWARDEN_RUN`` wins,
    ``TRAINWARDEN_URL`` fills in); ``init``: more ``tw.init`` arguments
    (``flush_interval_s=...``, ``profile_every=...``); ``watch``: more ``tw.watch``
    arguments (``replica_check_every=...``)."""

    name = "trainwarden"
    requires_logging_directory = False
    main_process_only = False  # every rank observes (see the module's docstring)

    def __init__(
        self,
        run_name: str | None = None,
        url: str | None = None,
        *,
        init: dict[str, Any] | None = None,
        watch: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.run_name, self._url = run_name, url
        self._init = dict(init or {})
        self._watch = dict(watch or {})
        self._config: dict[str, Any] | None = None
        self._started = False  # the start was tried (and said so, if it failed)
        self._observed = False  # it started the agent, or found the script's
        self._on = False  # watching: the hooks are in
        self._accelerator: Any = None
        self._optimizer: Any = None
        self._span = common.Span()
        self._tap: common.LossTap | None = None
        self._losses: list[Any] = []
        self._complete = False  # the open step's optimizer update ran
        self._next = 0  # the next step's number
        self._number = -1  # the open (or last) step's number
        self._done: int | None = None  # the last step whose update the model holds
        self._pending: dict[str, Any] = {}  # values logged between steps
        self._handles: list[Any] = []
        self._watched: Any = None  # what tw.watch installed
        self._patched: list[str] = []
        self._said_metrics = False
        self._broken = False  # failed: the hooks are to come off
        common.ask_flight_recorder(self._init)  # before the process group, if built first

    # -- Accelerate's tracker interface --------------------------------------------------

    @property
    def tracker(self) -> Any:
        """The running trainwarden agent (None until started)."""
        return _core._agent

    def start(self) -> None:
        """``init_trackers`` (main process only): the agent starts once the config is
        known, in :meth:`store_init_configuration`, else in :meth:`watch`."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        if self._started:
            log.warning(
                "trainwarden: accelerator.init_trackers came after tracker.watch: its config "
                "is not in the attempt's identity (call init_trackers first)"
            )
            return
        self._config = dict(values) if isinstance(values, dict) else None
        self._start()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """The numbers in ``values`` become the step's user metrics (``step`` is the
        loop's own number, unused: trainwarden numbers the optimizer steps itself)."""
        if self._on:
            self._guard(self._log, values)

    def finish(self) -> None:
        """``end_training``: the open step ends and the hooks come off (the agent
        flushes at the process's exit, or at ``tw.shutdown()``)."""
        if self._on and self._span.open:
            self._guard(self._close)
        self._detach()

    # -- the trainwarden side --------------------------------------------------------------

    def watch(
        self, accelerator: Any, model: Any, optimizer: Any = None, *, start_step: int | None = None
    ) -> TrainwardenTracker:
        """Observe ``model`` and ``optimizer``, as ``accelerator.prepare`` returned them,
        on this rank. Call it on **every** rank, after ``prepare`` and before
        ``accelerator.load_state`` (which then sets the step numbers); ``start_step``: the
        first step's number otherwise (default 0)."""
        if self._on:
            log.warning("trainwarden: tracker.watch was called twice: the first one stands")
            return self
        self._accelerator = accelerator
        if start_step is not None:
            self._next = int(start_step)
            self._done = self._next - 1 if self._next > 0 else None
        if not self._start():
            return self
        try:
            self._attach(accelerator, model, optimizer)
        except Exception as exc:  # the training goes on; the tracker goes quiet
            log.warning(
                "trainwarden: the Accelerate tracker could not attach (%s): unobserved", exc
            )
            self._detach()
        return self

    def step_end(self) -> None:
        """End the step now (else it ends at the next ``accelerator.log``, forward, ...):
        the wait for the next batch is then the next step's data wait. A rollback or a
        stop from the collector runs here."""
        if self._on and self._span.open:
            self._guard(self._close)

    @property
    def step(self) -> int:
        """The number of the step in progress, else of the next one."""
        return self._number if self._span.open else self._next

    # -- start and attach ------------------------------------------------------------------

    def _start(self) -> bool:
        if self._started:
            return self._observed and _core._agent is not None
        self._started = True
        self._observed = common.start(
            framework="Accelerate",
            package="accelerate",
            version=accelerate.__version__,
            run=self.run_name,
            url=self._url,
            config=self._facts(),
            init=self._init,
            place=_place(self._accelerator),
        )
        return self._observed

    def _facts(self) -> dict[str, Any]:
        facts = dict(self._config or {})
        facts["framework"] = f"accelerate {accelerate.__version__}"
        state = _accelerator_facts(self._accelerator)
        if state:
            facts.setdefault("accelerate", state)
        return facts

    def _attach(self, accelerator: Any, model: Any, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer's
        self._optimizer = inner
        self._on = True
        self._watched = tw_watch(model, inner, grad_norm=inner is not None, **self._watch)
        # Before tw.watch's forward mark: the step is open when it is taken.
        self._handles.append(model.register_forward_pre_hook(self._before_forward, prepend=True))
        self._tap = common.LossTap(model)
        if inner is not None:
            self._handles.append(inner.register_step_post_hook(self._after_update))
        self._handles.append(accelerator.register_save_state_pre_hook(self._before_save))
        self._handles.append(accelerator.register_load_state_pre_hook(self._before_load))
        wrappers = {
            "backward": self._wrap_backward,
            "clip_grad_norm_": self._wrap_clip_grad_norm,
            "log": self._wrap_log,
            "save_state": self._wrap_save_state,
            "end_training": self._wrap_end_training,
        }
        for name, wrap in wrappers.items():
            original = getattr(accelerator, name, None)
            if original is not None:
                setattr(accelerator, name, wrap(original))  # this instance only
                self._patched.append(name)
        on_rollback(self._rollback)

    def _detach(self) -> None:
        self._on = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._watched is not None:
            self._watched.remove()
            self._watched = None
        if self._tap is not None:
            self._tap.remove()
            self._tap = None
        accelerator = self._accelerator
        for name in self._patched:
            if accelerator is not None and name in vars(accelerator):
                delattr(accelerator, name)  # the class's own method again
        self._patched.clear()
        agent = _core._agent
        if agent is not None:
            agent.commands.off_rollback(self._rollback)

    def _guard(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except SystemExit:
            raise  # a stop command: the process ends at the step boundary
        except Exception as exc:
            log.warning(
                "trainwarden: the Accelerate tracker failed (%s): unobserved from here", exc
            )
            self._on = False  # the hooks go quiet at once; they come off at a safe place
            self._broken = True
            with contextlib.suppress(Exception):
                self._span.end()  # a step left open would read as one in progress
            return None

    def _tidy(self) -> None:
        """After a failure, take the hooks off: from a wrapped Accelerator method, never
        from inside a hook (a module's hooks cannot be removed while they run)."""
        if self._broken:
            self._broken = False
            self._detach()

    # -- the step: opened by a forward, complete after the update, closed at a boundary ----

    def _before_forward(self, module: Any, args: Any) -> None:
        if self._on and self._span.open and self._complete:
            self._guard(self._close)  # the step before ends here: a boundary
        if self._on and module.training and not self._span.open:
            self._guard(self._open)

    def _open(self) -> None:
        self._number, self._next = self._next, self._next + 1
        self._complete = False
        self._losses = []
        self._span.begin(self._number)
        if self._pending:
            pending, self._pending = self._pending, {}
            self._apply(pending)

    def _after_update(self, *_args: Any) -> None:
        if self._span.open:
            self._complete = True

    def _close(self) -> None:
        losses, self._losses = self._losses, []
        loss, tokens = self._tap.take() if self._tap is not None else (None, None)
        if len(losses) == 1:
            loss = losses[0]
        elif losses:
            import torch

            loss = torch.stack([v.float() for v in losses]).mean()  # on the device: no sync
        step = self._step_object()
        if loss is None and step is not None:
            loss = (step._record.metrics or {}).get("loss")  # a logged one
        if self._optimizer is not None:
            lr = self._optimizer.param_groups[0].get("lr")
            if isinstance(lr, (int, float)) and step is not None:
                step.lr(float(lr))
        if self._complete:
            self._done = self._number
        self._complete = False
        # A rollback (which renumbers the next step) or a stop may run in here.
        self._span.end(loss=loss, tokens=tokens)

    def _step_object(self) -> Any:
        return self._span.step  # the open tw.step's Step

    def _holds(self) -> int | None:
        """The last step whose update the model holds now."""
        return self._number if self._span.open and self._complete else self._done

    # -- what the loop logs ----------------------------------------------------------------

    def _log(self, values: dict[str, Any]) -> None:
        numbers = _numbers(values)
        if not self._span.open:
            self._pending.update(numbers)  # the next step's
            return
        self._apply(numbers)
        if self._complete:
            self._close()  # the loop logs after its update: the step's end

    def _apply(self, numbers: dict[str, Any]) -> None:
        for name, value in numbers.items():
            self._metric(name, value)

    def _metric(self, name: str, value: Any) -> None:
        step = self._step_object()
        if step is None:
            return
        try:
            step.metric(name, value)
        except ValueError as exc:  # over 32 names a step: the rest are left out, said once
            if not self._said_metrics:
                self._said_metrics = True
                log.warning("trainwarden: a logged value is not kept as a metric (%s)", exc)

    # -- the Accelerator's methods, wrapped on this instance -------------------------------

    def _wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def backward(loss: Any, **kwargs: Any) -> Any:
            self._tidy()
            if self._on:
                self._guard(self._saw_loss, loss)
            return original(loss, **kwargs)

        return backward

    def _saw_loss(self, loss: Any) -> None:
        if self._span.open and self._complete:
            self._close()
        if not self._span.open:
            self._open()  # the forward was another module's: the step starts here
        if getattr(loss, "ndim", None) == 0:
            self._losses.append(loss.detach())  # before Accelerate divides it
        if self._optimizer is None and self._accelerator.sync_gradients:
            self._complete = True  # no optimizer to watch: the last micro-batch's backward

    def _wrap_clip_grad_norm(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = original(*args, **kwargs)
            agent = _core._agent
            record = agent.recorder.current if self._on and agent is not None else None
            if record is not None and norm is not None:
                record.grad_norm = capture(norm)  # before clipping; read off this thread
            return norm

        return clip_grad_norm_

    def _wrap_log(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def log_(values: dict[str, Any], step: int | None = None, **kwargs: Any) -> Any:
            self._tidy()
            result = original(values, step=step, **kwargs)
            accelerator = self._accelerator
            # Accelerate calls its trackers on the main process only.
            if not accelerator.is_main_process or self not in (accelerator.trackers or ()):
                self.log(values, step=step)
            return result

        return log_

    def _wrap_save_state(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def save_state(*args: Any, **kwargs: Any) -> Any:
            self._tidy()
            step = self._holds() if self._on else None
            if step is None or not self._accelerator.is_main_process:
                return original(*args, **kwargs)
            with checkpointing(step) as ck:  # its blocking time, and its size
                location = original(*args, **kwargs)
                ck.path = os.fspath(location) if location is not None else None
            return location

        return save_state

    def _wrap_end_training(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def end_training(*args: Any, **kwargs: Any) -> Any:
            self.finish()  # every rank: Accelerate calls its trackers on the main one only
            return original(*args, **kwargs)

        return end_training

    def _before_save(self, _models: Any, _weights: Any, output_dir: Any) -> None:
        step = self._holds() if self._on else None
        if step is not None and self._accelerator.is_main_process:
            with open(os.path.join(output_dir, STEP_FILE), "w") as f:
                json.dump({"step": step}, f)

    def _before_load(self, _models: Any, input_dir: Any) -> None:
        try:
            with open(os.path.join(input_dir, STEP_FILE)) as f:
                saved = int(json.load(f)["step"])
        except (OSError, ValueError, KeyError, TypeError):
            log.info("trainwarden: %s has no %s: step numbers go on", input_dir, STEP_FILE)
            return
        if self._span.open:
            self._guard(self._close)
        self._done, self._next = saved, saved + 1

    # -- a rollback, in-process ----------------------------------------------------------

    def _rollback(self, plan: RollbackPlan) -> None:
        accelerator = self._accelerator
        keep = accelerator.step  # the place in the gradient accumulation is this loop's
        accelerator.load_state(plan.checkpoint_path)
        accelerator.step = keep
        if plan.lr_scale:
            for optimizer in getattr(accelerator, "_optimizers", ()):
                for group in getattr(optimizer, "optimizer", optimizer).param_groups:
                    group["lr"] *= plan.lr_scale
            for scheduler in getattr(accelerator, "_schedulers", ()):
                inner = getattr(scheduler, "scheduler", scheduler)
                if hasattr(inner, "base_lrs"):
                    inner.base_lrs = [lr * plan.lr_scale for lr in inner.base_lrs]
        self._done, self._next = plan.checkpoint_step, plan.checkpoint_step + 1
        if plan.skip_to < plan.skip_from:
            log.warning(
                "trainwarden: rollback %d asks to replay the same data; the loop's data loader "
                "goes on forward: later batches are trained on instead",
                plan.action,
            )
        log.warning(
            "trainwarden: rolled back to %s (step %d) after step %d",
            plan.checkpoint_path,
            plan.checkpoint_step,
            plan.barrier_step,
        )


def _numbers(values: Any) -> dict[str, Any]:
    """The scalars of a logged dict, under metric names (``^[a-z][a-z0-9_.]{0,31}$``)."""
    out: dict[str, Any] = {}
    if not isinstance(values, dict):
        return out
    for key, value in values.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            number: Any = float(value)
        elif getattr(value, "ndim", None) == 0 and hasattr(value, "detach"):
            number = value.detach()  # a 0-d tensor: read off the training thread
        elif hasattr(value, "item") and getattr(value, "shape", None) == ():
            number = float(value.item())  # a numpy scalar
        else:
            continue
        name = _NOT_NAME.sub("_", str(key).lower().replace("/", "."))
        if not name or not name[0].isalpha():
            name = f"m_{name}"
        out[name[:32]] = number
    return out


def _place(accelerator: Any) -> tuple[int, int, int] | None:
    """The rank, world size and local rank Accelerate's state holds (any launcher)."""
    if accelerator is None:
        return None
    return (
        accelerator.process_index,
        accelerator.num_processes,
        accelerator.local_process_index,
    )


def _accelerator_facts(accelerator: Any) -> dict[str, Any]:
    """The Accelerator's facts (from it, else from Accelerate's shared state)."""
    try:
        if accelerator is None:
            from accelerate.state import AcceleratorState, GradientState

            if not AcceleratorState._shared_state:
                return {}
            state: Any = AcceleratorState()
            steps = GradientState().num_steps
        else:
            state = accelerator.state
            steps = accelerator.gradient_accumulation_steps
        return {
            "num_processes": int(state.num_processes),
            "distributed_type": str(
                getattr(state.distributed_type, "value", state.distributed_type)
            ),
            "mixed_precision": str(state.mixed_precision),
            "gradient_accumulation_steps": int(steps),
        }
    except Exception:
        return {}
