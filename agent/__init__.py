"""trainwarden's per-rank agent. Import it as ``import trainwarden.agent as tw``.

    tw.init(run="my-run", url="http://collector:8000", config={"lr": 3e-4}, tags=["baseline"])
    for step, batch in enumerate(loader):
        with tw.step(step, tokens=batch.numel()) as s:
            loss = model(batch); loss.backward(); opt.step(); opt.zero_grad()
            s.loss(loss)
        if step % 1000 == 0:
            with tw.checkpointing(step, path):
                torch.save(state, path)
    tw.shutdown()

This module stays light: it never imports fastapi, sqlalchemy, dash or plotly.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import core as _core
from . import exit_hooks as _exit_hooks
from .checkpoints import Checkpointing
from .commands import STOPPED_EXIT_CODE, RollbackPlan
from .config import AgentConfig, ConfigError, InitOptions
from .core import Agent
from .exporter import Transport
from .step import Step
from .watch import Watch
from .watch import watch as _watch

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Agent",
    "AgentConfig",
    "Checkpointing",
    "ConfigError",
    "RollbackPlan",
    "STOPPED_EXIT_CODE",
    "Step",
    "Transport",
    "Watch",
    "checkpoint_drained",
    "checkpoint_saved",
    "checkpointing",
    "end_epoch",
    "event",
    "init",
    "on_rollback",
    "recent",
    "should_skip_batch",
    "shutdown",
    "stats",
    "step",
    "watch",
    "watch_loader",
]


def init(
    run: str | None = None,
    url: str | None = None,
    token: str | None = None,
    *,
    transport: Transport | None = None,
    **options: Unpack[InitOptions],
) -> Agent:
    """Start the agent for this process.

    Every argument falls back to a ``TRAINWARDEN_*`` environment variable
    (``TRAINWARDEN_RUN``, ``TRAINWARDEN_URL``, ``TRAINWARDEN_TOKEN``, ...); rank,
    world size and local rank come from ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``,
    else from the default process group once it exists (nothing is sent until then:
    :mod:`trainwarden.agent.placement`).
    With no URL the agent still works and keeps its last records in memory.

    MFU: give ``flops_per_step`` or ``flops_per_token`` (e.g. 6 x parameters for a
    dense transformer), or call :func:`watch`, which counts one step's FLOPs with
    ``FlopCounterMode``. The peak comes from ``peak_flops``, else the table entry for
    this GPU and ``dtype`` (default bf16), else, on a CPU, a short matmul measurement.

    ``profile_every``: one step in N runs under ``torch.profiler`` (the first at step
    20) to split its time into compute, exposed / overlapped communication and idle;
    0 turns it off. ``profile_dir`` keeps those traces (default: discarded).

    Health: a heartbeat goes out every ``heartbeat_s`` (2 s) even when the training
    thread is stuck; the NVML sampler reads this rank's GPU every ``gpu_interval_s``
    (5 s) and an XID watcher waits on NVML events. ``drill`` injects faults (see
    :mod:`trainwarden.agent.drills`).

    ``exporter``: ``"http"`` (default) posts to the collector's JSON API; ``"otlp"``
    sends OTLP/HTTP metrics to ``<url>/v1/metrics`` (a trainwarden collector, or an
    OpenTelemetry Collector in between); it needs ``pip install 'trainwarden[otlp]'``.
    ``relay`` (``TRAINWARDEN_RELAY``): the node relay, which sends the node's ranks'
    batches to the collector in one request: ``"auto"`` (local rank 0's agent runs the
    job's relay: the default where the launcher says a node runs several of the job's
    ranks, :mod:`trainwarden.agent.node_relay`), ``"off"``, or the URL of a relay you run
    (``trainwarden relay``, :mod:`trainwarden.agent.relay`); while it is down the agent
    sends to ``url`` itself.

    Collector away: batches wait in a spool on disk (``spool_dir``, default
    ``$TMPDIR/trainwarden-spool-<uid>``, at most ``spool_max_mb``, 256 MB; ``"none"``:
    in memory) and go out in order when it answers again, from this process or the
    next one of the same run and rank. The training thread never waits for it.

    Run identity: ``config`` (a mapping of hyperparameters; values that are not JSON,
    such as a torch dtype or a path, are kept as text), ``tags`` (a list of strings,
    ``TRAINWARDEN_TAGS="a,b"``) and ``data_snapshot`` (the data version,
    ``TRAINWARDEN_DATA_SNAPSHOT``) go to the collector once per process, in its
    ``attempt_start`` event, with the code version (git commit, dirty flag, branch; or
    ``TRAINWARDEN_CODE_VERSION``), the environment (Python, torch, CUDA, NCCL, GPU,
    driver, host, a hash of the installed packages; rank 0 sends the list) and the
    launcher's attempt (torchelastic restart, Slurm job and restart, or
    ``TRAINWARDEN_ATTEMPT``). A background thread gathers them: ``init`` does not wait.
    The process's end sends ``attempt_end`` with its reason: ``completed``
    (:func:`shutdown` or a normal exit), ``exception`` (an uncaught one),
    ``sigterm`` or ``stopped`` (the collector's stop command).

    Hung collectives: ``init`` turns on PyTorch's Flight Recorder
    (``TORCH_FR_BUFFER_SIZE``, ``flight_recorder_entries`` entries, 2,000; 0: off;
    ``TRAINWARDEN_FLIGHT_RECORDER_ENTRIES``; a value the user set is kept), so call it
    **before** ``torch.distributed.init_process_group``. When the collector asks (a rank
    is hung) or this rank's training thread has not finished a step for the hung
    threshold, the exporter thread sends the newest collectives of each process group
    (a ``collectives`` event), and the collector names the rank that never arrived.

    Data: ``dataset_size`` (``TRAINWARDEN_DATASET_SIZE``): the samples an epoch holds;
    with it the sample ids the steps give (``s.samples``, or :func:`watch_loader`) are
    checked for repeats and gaps at each epoch's end (exactly up to 1,048,576 samples, on
    a fixed sample of the dataset beyond). ``data_mixture``: the share of tokens each
    source should give, e.g. ``{"web": 0.7, "code": 0.2, "math": 0.1}`` (weights >= 0
    summing to 1), compared with what ``s.data_source(name, tokens)`` reports.

    Preflight: ``preflight=True`` (``TRAINWARDEN_PREFLIGHT=1``) checks this rank's device,
    memory, collective path and (on a GPU) NVML at the first step's entry, before step 0
    (:mod:`trainwarden.agent.preflight`); the collector compares the ranks and pages
    PreflightFailed on an outlier or a hard fault.

    The keyword arguments are declared once, as :class:`InitOptions` (their types) and
    :class:`AgentConfig` (their defaults and meaning); ``transport`` replaces how batches
    are sent (tests). Raises :class:`ConfigError` at once when an argument is wrong or
    unknown. Calling it again shuts the previous agent down first.
    """
    config = AgentConfig.resolve(run=run, url=url, token=token, **options)
    if _core._agent is not None:
        _core._agent.shutdown()
    agent = Agent(config, transport=transport)
    _core.set_current(agent)
    if config.flush_on_sigterm:
        _exit_hooks.install_sigterm_flush()
    _exit_hooks.install_excepthook()
    return agent


def _init_signature() -> inspect.Signature:
    """``init``'s signature with every :class:`InitOptions` argument named, for
    ``help(tw.init)`` and ``inspect`` (type checkers read ``InitOptions`` itself)."""
    own = list(inspect.signature(init).parameters.values())[:-1]  # without **options
    keywords = [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=getattr(kind, "__forward_arg__", kind),  # the text, as for the others
        )
        for name, kind in InitOptions.__annotations__.items()
    ]
    return inspect.signature(init).replace(parameters=[*own, *keywords])


init.__signature__ = _init_signature()  # type: ignore[attr-defined]


def step(step: int, tokens: Any = None) -> Step:
    """Time one training step: ``with tw.step(i, tokens=n) as s: ...``.

    ``tokens`` is the number of tokens this rank processed in the step (an int, or a
    CPU tensor's ``numel()``); it feeds tokens/s and, later, MFU.
    """
    return _core.current().step(step, tokens)


def watch(
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
    """Install hooks that time forward / backward / optimizer and split communication.

    - ``model``: the module the trainer calls (a ``DistributedDataParallel`` wrapper gets
      a communication hook that times each gradient bucket's collective; call this
      before your own ``register_comm_hook``, which is then chained, not replaced);
    - ``optimizer``: its step hooks mark the optimizer phase;
    - ``grad_norm=True``: the agent computes the global gradient norm on the device
      (foreach norms) before each optimizer step, for spike flags;
    - ``count_flops``: count one step's FLOPs for MFU (default: when no FLOPs were given);
    - ``replica_check_every`` (``TRAINWARDEN_REPLICA_CHECK_EVERY``, default 100; 0: off):
      after the optimizer step of every step whose number is a multiple of it, the agent
      fingerprints the model's parameters on the device (no host sync) and sends it with
      the step; the collector compares the fingerprints of the ranks that hold the same
      parameters and names a replica that differs (silent data corruption). Needs the
      optimizer. :mod:`trainwarden.agent.replica` says what is fingerprinted;
    - ``replica_group``: who holds the same parameters as this rank, a ``ProcessGroup`` or
      a list of global ranks. Default: a DDP model's process group; for FSDP2 / HSDP the
      mesh's replicate dimension (plain FSDP2 has no replica: no check); any other model
      (a hand-written data-parallel loop, a tensor or pipeline shard): no check unless
      given. Call ``tw.watch`` after wrapping the model (DDP, ``fully_shard``).
    - ``determinism_probe_every`` (``TRAINWARDEN_DETERMINISM_PROBE_EVERY``, default 0: off):
      at steps whose number is a multiple of it, after the optimizer step, each replica
      also runs one forward of a fixed input (``probe_input``, else one built from the
      first forward's shapes) in eval mode under ``no_grad`` and fingerprints the
      output: replicas must compute equal outputs (catches wrong arithmetic that leaves
      the parameters equal). Needs a replica group, as the replica check does;
    - ``probe_rtol`` (``TRAINWARDEN_PROBE_RTOL``, default 0: bit-exact): for models whose
      kernels are not deterministic, how far two replicas' probe sums may differ,
      relative to the output's L1 norm. :mod:`trainwarden.agent.probe` says more.
    """
    return _watch(
        _core.current(),
        model,
        optimizer,
        grad_norm=grad_norm,
        comm=comm,
        count_flops=count_flops,
        replica_check_every=replica_check_every,
        replica_group=replica_group,
        determinism_probe_every=determinism_probe_every,
        probe_input=probe_input,
        probe_rtol=probe_rtol,
    )


def event(kind: str, *, step: int | None = None, severity: str = "info", **data: Any) -> None:
    """Record an event of this rank (kept with the run and shown on its timeline)."""
    _core.current().event(kind, step=step, severity=severity, **data)


def checkpoint_saved(
    step: int,
    path: Any,
    *,
    seconds: float | None = None,
    bytes: int | None = None,  # noqa: A002 - the size, named as users say it
    drain_seconds: float | None = None,
    **meta: Any,
) -> None:
    """Report that the trainer saved a checkpoint of ``step`` at ``path`` (the agent
    never writes checkpoints itself). The collector keeps them with the run (rollbacks
    restore them); the CheckpointStale alert fires when none has been reported for 2 hours.

    ``step``: the checkpoint holds the weights after the optimizer update of this step.
    A rollback for an anomaly that began at step k restores only a checkpoint with
    ``step <= k - 2`` (the loss of k is computed after update k - 1); a trainer that
    saves before its optimizer step must pass its step - 1.

    ``seconds``: how long the save blocked training; ``bytes``: its size;
    ``drain_seconds``: how long an async save took to finish writing after that. They
    feed the checkpoint cost and the cadence advice; a wrong type or a negative or
    non-finite value raises ``TypeError`` / ``ValueError``. :func:`checkpointing` measures
    the first two for you."""
    _core.current().checkpoint_saved(
        step, path, seconds=seconds, bytes=bytes, drain_seconds=drain_seconds, **meta
    )


def checkpointing(step: int, path: Any = None) -> Checkpointing:
    """Time a checkpoint save: ``with tw.checkpointing(step, path) as ck: save(path)``.

    On a normal exit it reports :func:`checkpoint_saved` with ``seconds`` (the block's
    time) and ``bytes`` (the file's size, or the sum over a directory, read on a
    background thread); if the block raises, a ``checkpoint_failed`` warning, and the
    exception goes on. For an async save, call ``ck.drained()`` when it has finished
    writing: that reports the drain time since the block ended."""
    return _core.current().checkpointing(step, path)


def checkpoint_drained(step: int, seconds: float, path: Any = None) -> None:
    """Report that the async save of ``step``'s checkpoint finished writing ``seconds``
    after training went on (see also ``ck.drained()`` of :func:`checkpointing`)."""
    _core.current().checkpoint_drained(step, seconds, path)


def on_rollback(handler: Callable[[RollbackPlan], Any]) -> None:
    """Register the trainer's rollback: ``handler(plan)`` restores ``plan.checkpoint_path``
    (model, optimizer, data position; optionally scales the learning rate by
    ``plan.lr_scale``) and makes the training loop continue from
    ``plan.checkpoint_step + 1``. It runs on the training thread, between steps, at the
    same step on every rank (``plan.barrier_step``). A handler that raises fails the
    action, which pages; the agent keeps no state of its own to restore."""
    _core.current().commands.on_rollback(handler)


def should_skip_batch(index: int) -> bool:
    """True for the data batches a rollback asked to skip (the window that led up to the
    anomaly, see ``RollbackPlan.skip_from`` / ``skip_to``): ask it in your loader loop."""
    return _core.current().commands.should_skip_batch(index)


def watch_loader(loader: Any) -> Any:
    """Record the sample ids of each batch a map-style ``torch.utils.data.DataLoader``
    yields, without passing them: ``loader = tw.watch_loader(loader)``. Each step takes
    the ids of the batches fetched since the last step; an iteration that runs out ends
    its epoch (the sampler's ``epoch``, else the count of iterations); the dataset's
    length is the coverage check's size unless ``tw.init(dataset_size=...)`` gave one.
    A loader it cannot watch (an iterable-style dataset: no indices) is given back as
    it is, with a warning saying why (see :mod:`trainwarden.agent.loader`)."""
    from .loader import watch_loader as _watch_loader

    agent = _core.current()
    return _watch_loader(loader, agent.recorder.data, agent.use_dataset_size)


def end_epoch() -> None:
    """The current epoch is over (after its last step): the collector counts its
    repeated and missing samples once every rank ended it. A step given a new epoch
    (``s.samples(ids, epoch=e)``) ends the one before by itself, and so does a watched
    loader running out: call this for an epoch nothing follows."""
    _core.current().end_epoch()


def stats() -> dict[str, int]:
    """Counters of this process's agent: recorded, sent, dropped (and why)."""
    return _core.current().stats.as_dict()


def recent(n: int = 100) -> list[Any]:
    """The last ``n`` records kept in memory when running without a collector."""
    return _core.current().recent(n)


def shutdown(timeout_s: float = 5.0) -> None:
    """Flush what is queued (waiting at most ``timeout_s``) and stop the agent."""
    agent = _core._agent
    if agent is not None:
        if sys.exc_info()[1] is not None:  # in a `finally:` while an exception propagates
            agent.note_exit_in_flight()
        agent.shutdown(timeout_s)
        _core.set_current(None)
