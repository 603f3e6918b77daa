"""Who this process is in the job: its rank, the world's size and its rank on the node.

Where it comes from, first found wins:

1. ``tw.init(rank=..., world_size=..., local_rank=...)`` (the framework integrations pass
   the framework's own: Lightning's ``trainer.global_rank``, Accelerate's state, the
   Hugging Face Trainer's ``args``);
2. ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, as torchrun, ``accelerate launch``, the
   ``deepspeed`` launcher and ``torchrun`` under srun set them;
3. the default process group, once it exists (Lightning's own launcher,
   ``torch.multiprocessing.spawn``, a hand-made ``init_process_group(rank=r, ...)``,
   which set no ``RANK``; srun's tasks, ``SLURM_PROCID``): ``get_rank()`` and
   ``get_world_size()``; the rank on the node from ``LOCAL_RANK`` (or srun's
   ``SLURM_LOCALID``) where set, else from the group's hosts (:func:`local_rank_in_group`);
4. no group by the process's first step, or within ``TRAINWARDEN_IDENTITY_WAIT`` seconds
   (300) of ``tw.init``: the process is not distributed, rank 0 of 1 (or Slurm's
   ``SLURM_PROCID`` of ``SLURM_NTASKS``, where srun started it).

Until 3 or 4 decides, the agent sends nothing (:mod:`.core` holds the records back):
nothing leaves the process under a guessed identity. Where 1 or 2 said it and the group,
once it exists, says otherwise, the group wins, with one warning.

Reading the group calls no collective: the hosts go through the group's store, so the
trainer's collectives keep their sequence numbers (the Flight Recorder lines ranks up by
them).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

IDENTITY_WAIT_S = 300.0
"""How long a process with no rank from its launcher waits for its process group before
it calls itself rank 0 of 1 (unless a step comes first: ``TRAINWARDEN_IDENTITY_WAIT``)."""

_STORE_PREFIX = "trainwarden/placement"
_STORE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Place:
    """A process's place in its job, and where it was learnt."""

    rank: int
    world_size: int
    local_rank: int
    source: str
    """``argument``, ``environment``, ``process group`` or ``no process group``."""


def distributed() -> Any:
    """``torch.distributed`` when the trainer imported torch and the module works, else
    None. The agent never imports torch itself for this."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        dist = torch.distributed
        return dist if dist.is_available() else None
    except Exception:  # a torch built without distributed, or half imported
        return None


def group_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default process group, or None while there is none.
    Cheap: two attribute reads of torch's own state, no collective."""
    dist = distributed()
    if dist is None:
        return None
    try:
        if not dist.is_initialized():
            return None
        return int(dist.get_rank()), int(dist.get_world_size())
    except Exception:  # destroyed meanwhile, or a torch whose API moved
        return None


def env_int(name: str, environ: Any = None) -> int | None:
    value = (os.environ if environ is None else environ).get(name, "")
    return int(value) if value.strip().isdigit() else None


def without_group(environ: Any = None) -> Place:
    """The place of a process that made no process group: Slurm's task where srun started
    it (``SLURM_PROCID`` of ``SLURM_NTASKS``), else rank 0 of 1."""
    rank, world = env_int("SLURM_PROCID", environ), env_int("SLURM_NTASKS", environ)
    if rank is not None and world is not None and rank < world:
        local = env_int("SLURM_LOCALID", environ)
        return Place(rank, world, local if local is not None else 0, "no process group")
    return Place(0, 1, 0, "no process group")


def from_group(
    rank: int, world_size: int, *, host: str, run: str, timeout_s: float = _STORE_TIMEOUT_S
) -> Place:
    """The place the default group gives: its rank and size; the rank on the node from
    ``LOCAL_RANK`` where the launcher set it, or srun's ``SLURM_LOCALID`` where srun
    started each rank (its task count is the group's size: not srun starting one task
    that spawns the ranks), else from the group's hosts."""
    local = env_int("LOCAL_RANK")
    if local is None and env_int("SLURM_NTASKS") == world_size:
        local = env_int("SLURM_LOCALID")
    if local is None:
        local = local_rank_in_group(rank, world_size, host=host, run=run, timeout_s=timeout_s)
    return Place(rank, world_size, local, "process group")


def local_rank_in_group(
    rank: int, world_size: int, *, host: str, run: str, timeout_s: float = _STORE_TIMEOUT_S
) -> int:
    """This rank's index among the group's ranks on this host, in rank order (how torchrun
    numbers local ranks), learnt through the default group's store: each rank adds itself
    under its host, the last to arrive says so, then each reads its host's list. Every
    rank's agent does it, on its own thread; a rank that never comes (an agent on some
    ranks only) makes the others use the ranks seen so far after ``timeout_s``. 0 when the
    store cannot be used (a one-host job's rank 0 is right; the log says so)."""
    if world_size == 1:
        return 0
    dist = distributed()
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"{_STORE_PREFIX}/{run}"
        mine = store.add(f"{prefix}/host/{host}", 1) - 1
        store.set(f"{prefix}/host/{host}/{mine}", str(rank))
        if store.add(f"{prefix}/arrived", 1) >= world_size:
            store.set(f"{prefix}/all", "1")
        if not _poll(store, f"{prefix}/all", timeout_s):  # some rank has no agent
            log.warning(
                "trainwarden: not every rank's agent reported its host within %.0fs; "
                "the local rank counts the ranks seen so far",
                timeout_s,
            )
        count = int(store.add(f"{prefix}/host/{host}", 0))
        ranks = {int(store.get(f"{prefix}/host/{host}/{i}")) for i in range(count)}
        if rank in ranks:
            return sorted(ranks).index(rank)
    except Exception as exc:
        log.warning(
            "trainwarden: cannot learn the local rank from the process group's store (%s); "
            "set LOCAL_RANK: local rank 0 assumed",
            exc,
        )
    return 0


def _poll(store: Any, key: str, timeout_s: float) -> bool:
    """Whether ``key`` is set within ``timeout_s``, asked with ``check`` (at most every
    0.5 s): ``store.wait`` would hold the store client's lock while it waits, and the
    trainer's own use of the store (NCCL's communicator set-up) would wait behind it."""
    deadline = time.monotonic() + timeout_s
    pause = 0.02
    while True:
        if store.check([key]):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def differs(place: Place, rank: int, world_size: int) -> str | None:
    """A warning when the launcher's (or tw.init's) rank contradicts the process group's."""
    if (place.rank, place.world_size) == (rank, world_size):
        return None
    said = "tw.init's arguments" if place.source == "argument" else "the environment (RANK)"
    return (
        f"trainwarden: {said} say rank {place.rank} of {place.world_size}, the process "
        f"group says rank {rank} of {world_size}: the group's is used from now on "
        "(check RANK / WORLD_SIZE, or tw.init(rank=...), against init_process_group)"
    )
