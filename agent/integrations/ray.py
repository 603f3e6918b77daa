"""Ray Train: ``TorchTrainer(tw_ray.wrap(train_loop_per_worker), ...)``.

Install with ``pip install 'trainwarden[ray]'`` (``ray[train]`` in the range tested:
:data:`.common.TESTED`). The loop inside is the user's own: ``tw.step``, ``s.loss`` and
``tw.watch`` as in a hand-written loop; this module gives the agent what Ray knows.

- **Identity** (:func:`init`, which :func:`wrap` calls in each worker before the loop):
  the run is Ray's experiment name (``RunConfig(name=...)``; ``run=`` or
  ``TRAINWARDEN_RUN`` win); rank, world size and local rank are Ray's train context's
  (``get_world_rank()``, ``get_world_size()``, ``get_local_rank()``); the config holds
  the loop's config (``train_loop_config``), the node rank and ``framework``.
- **Attempts**: Ray restarts the whole worker group after a failure
  (``FailureConfig(max_failures=N)``), each time in a new placement group. The attempt
  key (``TRAINWARDEN_ATTEMPT``) is ``ray:<experiment>:<placement group id>``: every
  worker of one group shares it, a restart gets a new one. The restart count
  (``TRAINWARDEN_RESTART_COUNT``, which stops a ``die`` drill from firing again) is the
  number of earlier groups that left a marker in the experiment's storage
  (``<storage>/<experiment>/.trainwarden-attempts/``, one small file a worker, on Ray's
  own storage filesystem).
- **Checkpoints**: while :func:`wrap`'s loop runs, ``ray.train.report(metrics,
  checkpoint=...)`` on world rank 0 is reported (timed around the report: upload and
  barrier) as the weights after the last step this worker finished, at the path Ray
  persists it to (``<storage>/<experiment>/<checkpoint_dir_name>``; when the call names
  none, the name Ray would make, ``checkpoint_<timestamp>``, is made here and passed on).
- **Node relay**: Ray sets ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
  its torch workers, so ``relay="auto"`` runs one relay a node (its local rank 0) for the
  node's workers of one attempt, as under torchrun.
- **Actions**: a rollback reaches each worker's agent and runs the handler the loop
  registered (``tw.on_rollback``) at the step boundary, as in any loop. A **stop** raises
  ``SystemExit(tw.STOPPED_EXIT_CODE)`` at the step boundary; :func:`wrap` returns from the
  worker's loop then, so Ray ends the run as finished rather than restarting it as a
  failure. A stop of the run comes in two phases, so every worker stops after the same
  step (``trainwarden.agent.commands``): Ray does not tear the group down when one
  worker returns, and a worker a step behind would wait in that step's collective.

Nothing here fails the training: no collector URL, a ray outside the tested range, or an
error of the integration: one line in the log, training goes on unobserved.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import ray
import ray.train

from .. import STOPPED_EXIT_CODE, checkpointing, shutdown
from .. import core as _core
from . import common

log = logging.getLogger("trainwarden")

MARKERS = ".trainwarden-attempts"
"""The folder under the experiment's storage where each worker marks its attempt."""


def wrap(
    train_loop: Callable[..., Any],
    run: str | None = None,
    url: str | None = None,
    *,
    init: dict[str, Any] | None = None,
) -> Callable[..., Any]:
    """``train_loop`` observed in each Ray Train worker: :func:`init` first, checkpoints
    from ``ray.train.report``, a stop ends the loop cleanly, and the agent's last flush
    when it returns (Ray ends the worker's process without running ``atexit``)."""

    @functools.wraps(train_loop)
    def observed(*args: Any, **kwargs: Any) -> Any:
        config = args[0] if args else kwargs.get("config")
        on = _init(run, url, init=init, config=config)
        report = ray.train.report
        if on:
            ray.train.report = functools.partial(_report, report)
        try:
            return train_loop(*args, **kwargs)
        except SystemExit as stop:
            if stop.code != STOPPED_EXIT_CODE:
                raise
            log.warning("trainwarden: stopped: this Ray Train worker's loop ends here")
            return None
        finally:
            ray.train.report = report
            if on:
                shutdown()

    return observed


def init(
    run: str | None = None,
    url: str | None = None,
    *,
    init: dict[str, Any] | None = None,
    config: Any = None,
) -> bool:
    """Start the agent in a Ray Train worker from Ray's train context; False: unobserved
    (said once). Call it inside ``train_loop_per_worker`` (:func:`wrap` does)."""
    try:
        context = ray.train.get_context()
        place = (context.get_world_rank(), context.get_world_size(), context.get_local_rank())
        experiment = context.get_experiment_name()
        facts: dict[str, Any] = dict(config) if isinstance(config, dict) else {}
        facts.update(
            framework=f"ray {ray.__version__}",
            world_size=place[1],
            node_rank=context.get_node_rank(),
            experiment=experiment,
        )
    except Exception as exc:  # not in a Ray Train worker, or Ray changed
        log.warning("trainwarden: Ray Train: no train context (%s): unobserved", exc)
        return False
    if common.check_version("ray", ray.__version__) is None:  # else start() says so
        try:
            key, restarts = attempt(context, experiment, place[0])
        except Exception as exc:  # the storage refused the marker
            log.warning(
                "trainwarden: Ray Train: no attempt marker in the experiment's storage (%s): "
                "unobserved",
                exc,
            )
            return False
        os.environ["TRAINWARDEN_ATTEMPT"] = key
        os.environ["TRAINWARDEN_RESTART_COUNT"] = str(restarts)
    return common.start(
        framework="Ray Train",
        package="ray",
        version=ray.__version__,
        run=run or experiment,
        url=url,
        config=facts,
        init=dict(init or {}),
        place=place,
    )


_init = init  # wrap's own argument ``init`` hides the function's name there


def attempt(context: Any, experiment: str, rank: int) -> tuple[str, int]:
    """This worker group's attempt key and restart count (see the module's docstring)."""
    import pyarrow.fs

    group = ray.util.get_current_placement_group()
    # Outside a placement group (a local test mode), the rendezvous port names the group.
    name = group.id.hex() if group is not None else f"port{os.environ.get('MASTER_PORT', '')}"
    storage = context.get_storage()
    fs, folder = storage.storage_filesystem, f"{storage.experiment_fs_path}/{MARKERS}"
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(f"{folder}/{name}.{rank}") as out:
        out.write(f"{time.time()}\n".encode())
    marked = fs.get_file_info(pyarrow.fs.FileSelector(folder))
    groups = {os.path.basename(info.path).rsplit(".", 1)[0] for info in marked}
    # Groups run one after another: every earlier one marked before this one started.
    return f"ray:{experiment}:{name}", len(groups - {name})


def _report(report: Callable[..., Any], metrics: Any, *args: Any, **kwargs: Any) -> Any:
    """``ray.train.report``, with world rank 0's checkpoint reported to trainwarden."""
    checkpoint = args[0] if args else kwargs.get("checkpoint")
    timed = None
    try:
        agent = _core._agent
        step = agent.last_step if agent is not None else None
        context = ray.train.get_context()
        if checkpoint is not None and step is not None and context.get_world_rank() == 0:
            if len(args) < 2 and kwargs.get("checkpoint_dir_name") is None:
                # The name Ray would make (rank 0's is the one every rank uses), made
                # here so that the path is known.
                kwargs["checkpoint_dir_name"] = f"checkpoint_{_date_str()}"
            name = args[1] if len(args) >= 2 else kwargs["checkpoint_dir_name"]
            timed = checkpointing(step, f"{context.get_storage().experiment_fs_path}/{name}")
    except Exception as exc:  # the report goes on, unobserved
        log.warning("trainwarden: Ray Train: a checkpoint not reported (%s)", exc)
    if timed is None:
        return report(metrics, *args, **kwargs)
    with timed:
        return report(metrics, *args, **kwargs)


def _date_str() -> str:
    # Ray's own name for a checkpoint folder, from where Ray makes it (not public API: a
    # Ray outside the tested range fails here, and the report goes on unobserved).
    from ray.train.v2._internal.util import date_str  # noqa: PLC2701

    return str(date_str(include_ms=True))
