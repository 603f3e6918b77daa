"""How an :class:`~.core.Agent` settles its place in the job (:mod:`.placement` says where
a rank can come from): a process started without a rank waits, on the identity thread, for
the default process group, a step or the deadline; a rank said by ``tw.init`` or the
launcher is checked against the process group once it exists, and the group's wins; the
drill's faults are built for the rank as known when first needed. A mixin of ``Agent``:
these methods share its state (``config``, the place lock, the settle event).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import placement, preflight
from .drills import Drill, DrillError

if TYPE_CHECKING:
    from .config import AgentConfig
    from .drills import Fault
    from .encode import StepEncoder
    from .rare import RareWork

log = logging.getLogger(__name__)

_PLACE_POLL_S = 0.05  # how often a process with no rank yet looks for its process group


class RankSettling:
    """The ``Agent``'s methods that find, check and correct its rank, and what its first step
    does (the drill, the preflight) (mixed into it)."""

    # What they use of the Agent (set in its __init__).
    config: AgentConfig
    rare: RareWork
    _drill_spec: list[Fault] | None
    _place_lock: threading.Lock
    _settle: threading.Event  # a step ran, or the agent is shutting down
    _connected: threading.Event  # the rank is final and the exporter made
    _closed: bool
    _connect: Callable[[], None]
    _encode: StepEncoder
    event: Callable[..., None]

    def _make_drill(self) -> None:
        """The drill's faults for this rank: built once, from the rank as known when it is
        first needed (``tw.watch``, the first step, the GPU sampler); a process still
        without its rank takes the group's, else rank 0 of 1's, as it will report."""
        with self._place_lock:
            spec, self._drill_spec = self._drill_spec, None
            if spec is None:
                return
            c = self.config
            rank, world = c.rank, c.world_size
            if c.placement == "pending":
                group = placement.group_rank()
                if group is None:
                    alone = placement.without_group()
                    group = (alone.rank, alone.world_size)
                rank, world = group
            try:
                self.rare.use_drill(Drill(spec, rank=rank, world_size=world))
            except DrillError as exc:  # the group's world is smaller than the drill's rank
                log.warning("trainwarden: the drill is off: %s", exc)

    def _first_step(self) -> None:
        """The first step's entry (training thread): a drill acts from it on, and a process
        still without its rank settles it (a step without a process group: none will come)."""
        if self.config.placement != "pending":
            self._verify_place()  # before this step's record leaves under a wrong rank
        if self._drill_spec is not None:
            self._make_drill()
        self._settle.set()
        if self.config.preflight:
            self._preflight()

    def _preflight(self) -> None:
        """``tw.init(preflight=True)``: this rank's checks before step 0, sent as its
        ``preflight`` event (:mod:`.preflight`). One that cannot measure says why in the
        event and the log; the training goes on."""
        drill = self.rare.drill.preflight() if self.rare.drill is not None else None
        peak = self._encode.peak
        try:
            found = preflight.measure(drill=drill, peak_flops=peak.flops if peak else None)
        except Exception as exc:
            log.warning("trainwarden: preflight could not measure: %s", exc)
            self.event("preflight", severity="warning", error=f"{type(exc).__name__}: {exc}")
            return
        severity = "warning" if found["faults"] else "info"
        self.event("preflight", severity=severity, **found)

    # -- the process's place in the job (placement.py) ----------------------------------

    def _find_place(self) -> None:
        """Wait for the default process group, a step, the agent's shutdown or the
        deadline, whichever is first; take the place it gives; then connect."""
        c = self.config
        deadline = time.monotonic() + c.identity_wait_s
        place: placement.Place | None = None
        while place is None:
            group = placement.group_rank()
            if group is not None:
                place = placement.from_group(*group, host=c.host, run=c.run)
            elif self._settle.is_set() or time.monotonic() >= deadline:
                place = placement.without_group()
                if not self._settle.is_set():
                    log.warning(
                        "trainwarden: no RANK from the launcher and no process group after "
                        "%.0fs: reporting as rank %d of %d (TRAINWARDEN_IDENTITY_WAIT)",
                        c.identity_wait_s,
                        place.rank,
                        place.world_size,
                    )
            else:
                self._settle.wait(_PLACE_POLL_S)
        try:
            self._move_to(place)
            self._connect()
        finally:
            self._connected.set()

    def _move_to(self, place: placement.Place) -> None:
        self.config = dataclasses.replace(
            self.config,
            rank=place.rank,
            world_size=place.world_size,
            local_rank=place.local_rank,
            placement=place.source,
        )
        self.rare.use_config(self.config)

    def _check_place(self) -> None:
        """Rank from tw.init or the environment: once the process group exists (within
        the identity wait), the group's rank wins if they differ, with one warning."""
        c = self.config
        if c.placement not in ("argument", "environment"):
            return
        deadline = time.monotonic() + c.identity_wait_s
        while not self._closed and time.monotonic() < deadline:
            if self._verify_place():
                return
            if self._settle.is_set():  # steps without a group: not a distributed process
                return
            self._settle.wait(_PLACE_POLL_S)

    def _verify_place(self) -> bool:
        """Whether the process group exists; if it does and contradicts the rank said,
        move to the group's (once: from either thread). The local rank stays the
        launcher's (``LOCAL_RANK``) or the one said: no store exchange here."""
        group = placement.group_rank()
        if group is None:
            return False
        with self._place_lock:
            c = self.config
            if c.placement not in ("argument", "environment"):
                return True
            said = placement.Place(c.rank, c.world_size, c.local_rank, c.placement)
            warning = placement.differs(said, *group)
            if warning is None:
                return True
            local = placement.env_int("LOCAL_RANK")
            self._move_to(
                placement.Place(*group, c.local_rank if local is None else local, "process group")
            )
        log.warning(warning)
        self.event("rank_corrected", severity="warning", was=c.rank, message=warning)
        return True
